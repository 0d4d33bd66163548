"""The stages of scripts/gpu_check, one function each: (a) kernels against their references, (b) kernel
bandwidth, (c) decode step time against its floor, (d) engine tok/s against transformers' continuous batching,
(e) a tiny model's tokens against HF `generate`.

Each takes a Ctx and returns rows: {check, value, reference, ok, note}; ok is True/False against the issue's
target, or None where a number has no target. With ctx.smoke the same code runs on the CPU on tiny shapes
(kernels under TRITON_INTERPRET=1), so the table, the files and the imports are checked without a GPU.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
QWEN_HEADS = (14, 2, 64)  # Qwen2.5-0.5B: q heads, kv heads, head_dim


@dataclass
class Ctx:
    smoke: bool

    @property
    def device(self) -> str:
        return "cpu" if self.smoke else "cuda"

    @property
    def dtype(self) -> str:
        return "float32" if self.smoke else "bfloat16"


def row(check: str, value: str, reference: str = "", ok: bool | None = None, note: str = "") -> dict:
    return dict(check=check, value=value, reference=reference, ok=ok, note=note)


def sync(ctx: Ctx) -> None:
    if not ctx.smoke:
        torch.cuda.synchronize()


def time_ms(ctx: Ctx, fn) -> float:
    """Median milliseconds of fn: CUDA events via do_bench on the GPU, a few host-timed calls on the CPU."""
    if not ctx.smoke:
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()
    times = []
    for _ in range(2):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def copy_bandwidth(ctx: Ctx) -> float:
    """Bytes read + written per second by a large device copy (64 MiB on the CPU smoke, 2 GiB on the GPU)."""
    src = torch.empty((64 << 20) if ctx.smoke else (2 << 30), dtype=torch.uint8, device=ctx.device)
    dst = torch.empty_like(src)
    ms = time_ms(ctx, lambda: dst.copy_(src))
    return 2 * src.numel() / (ms * 1e-3)


# ---------------------------------------------------------------- (a) kernels against their references

def stage_kernels(ctx: Ctx) -> list[dict]:
    from benchmarks import bench_kernels
    rows = []
    cases = bench_kernels.correctness_cases(torch, smoke=False)
    if ctx.smoke:  # the interpreter runs every program in Python: one small case, still several partitions
        cases = [(torch.float32, (4, 2, 32), 16, [1, 17, 40], 16)]
    results = bench_kernels.check_correctness(torch, ctx.device, cases)
    bad = [case for case, _, ok in results if not ok]
    worst = max(err for _, err, _ in results)
    rows.append(row("paged decode (multi-partition) / prefill / write_kv vs reference",
                    f"{len(results) - len(bad)}/{len(results)} cases", "all", not bad,
                    f"max abs err {worst:.1e}" + (f"; failed: {bad[:3]}" if bad else "")))
    if ctx.smoke:  # the fused-kernel suite under the interpreter takes minutes: the GPU runs it whole
        return rows
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/kernels/test_kernels.py",
         "tests/kernels/test_kernels_fused.py", "-k", "not interpreter_suite and not sm90"],
        cwd=ROOT, capture_output=True, text=True)
    summary = (proc.stdout.strip().splitlines() or ["no output"])[-1]
    rows.append(row("tests/test_kernels*.py on CUDA (fp32/bf16/fp16, awkward shapes)", summary[:60], "all pass",
                    proc.returncode == 0, "" if proc.returncode == 0 else proc.stdout[-400:].replace("\n", " ")))
    return rows


# ---------------------------------------------------------------- (b) kernel bandwidth, prefill vs SDPA

def stage_bandwidth(ctx: Ctx) -> list[dict]:
    from kernels.decode_attention import paged_decode_attention_triton

    bw = copy_bandwidth(ctx)
    rows = [row("device copy bandwidth (read + write)", f"{bw / 1e9:,.0f} GB/s")]
    if ctx.smoke:
        hq, hk, d = 4, 2, 32
        grid = [(2, 64)]
    else:
        hq, hk, d = QWEN_HEADS
        grid = [(b, c) for b in (1, 64, 256) for c in (1024, 4096)]
    dtype = torch.float32 if ctx.smoke else torch.bfloat16
    for batch, ctx_len in grid:
        blocks = ctx_len // 16
        k_cache = torch.randn(batch * blocks, 16, hk, d, device=ctx.device, dtype=dtype)
        v_cache = torch.randn_like(k_cache)
        table = torch.randperm(batch * blocks, device=ctx.device).to(torch.int32).view(batch, blocks)
        seq_lens = torch.full((batch,), ctx_len, dtype=torch.int32, device=ctx.device)
        q = torch.randn(batch, hq, d, device=ctx.device, dtype=dtype)
        ms = time_ms(ctx, partial(paged_decode_attention_triton, q, k_cache, v_cache, table, seq_lens, d**-0.5))
        gbps = 2 * k_cache.numel() * k_cache.element_size() / (ms * 1e-3)
        share = gbps / bw
        rows.append(row(f"decode attention batch {batch} ctx {ctx_len}", f"{gbps / 1e9:,.0f} GB/s = {share:.0%}",
                        ">= 80% at batch >= 64", (share >= 0.8) if batch >= 64 and not ctx.smoke else None,
                        f"{ms * 1e3:.1f} us"))
        del k_cache, v_cache
    if not ctx.smoke:
        from triton.testing import do_bench

        from benchmarks import bench_kernels

        for batch, ctx_len in ((16, 1024), (16, 4096)):
            r = bench_kernels.bench_config(torch, do_bench, "0.5B", QWEN_HEADS, batch, ctx_len, bw)
            ours, sdpa = r[7], r[9]
            rows.append(row(f"prefill batch {batch} ctx {ctx_len} (512-token chunk)", f"{ours:,.0f} us",
                            "SDPA " + ("n/a" if sdpa is None else f"{sdpa:,.0f} us"),
                            None if sdpa is None else ours <= 1.5 * sdpa, f"{r[8]:.0f} TFLOP/s"))
    return rows


# ---------------------------------------------------------------- model checkpoints in real shapes

def model_name(ctx: Ctx) -> str:
    # the smoke run takes SmolLM2's shape (bench_gpu's SMOKE sizes): a 151,936-token vocabulary costs a
    # minute of random init on a CPU
    return "SmolLM2-135M" if ctx.smoke else "Qwen2.5-0.5B"


def checkpoint(ctx: Ctx, name: str) -> str:
    """A random-weight checkpoint in `name`'s shapes, made once per gpu_check run (stages c and d share it)."""
    from benchmarks import bench_gpu
    directory = Path(os.environ.get("GPU_CHECK_CACHE") or tempfile.mkdtemp(prefix="gpu-check-")) / name
    if not (directory / "config.json").is_file():
        shape = bench_gpu.SHAPES[name] | (bench_gpu.SMOKE if ctx.smoke else {})
        bench_gpu.make_checkpoint(str(directory), shape, ctx.device)
    return str(directory)


# ---------------------------------------------------------------- (c) decode step time against the floor

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def profile_counts(ctx: Ctx, engine, steps: int) -> tuple[float, float]:
    """(kernel launches, host syncs) per engine step, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([] if ctx.smoke else [ProfilerActivity.CUDA])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
    events = prof.events()
    launches = sum(1 for e in events if "LaunchKernel" in e.name or e.name == "cudaGraphLaunch")
    syncs = sum(1 for e in events if e.name in SYNC_CALLS)
    return launches / steps, syncs / steps


def stage_decode(ctx: Ctx) -> list[dict]:
    from worker import Engine, SamplingParams
    from worker.engine.model_runner import kv_bytes_per_block

    bw = copy_bandwidth(ctx)
    batches, context = ((1, 2), 16) if ctx.smoke else ((1, 64, 256), 1024)
    rows = []
    path = checkpoint(ctx, model_name(ctx))
    for graphs in (True,) if ctx.smoke else (True, False):  # no graphs on a CPU
        for batch in batches:
            engine = Engine(path, device=ctx.device, dtype=ctx.dtype, max_num_seqs=batch,
                            max_num_batched_tokens=max(8192 if not ctx.smoke else 256, batch),
                            kv_cache_gb=0.25 if ctx.smoke else 16, cuda_graphs=graphs,
                            cpu_kernels=not ctx.smoke)
            gen = torch.Generator().manual_seed(batch)
            for i in range(batch):
                prompt = torch.randint(3, 49152, (context,), generator=gen).tolist()
                engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=64, temperature=0.0,
                                                                   ignore_eos=True))
            while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) or \
                    engine.scheduler.waiting:
                engine.step()
            for _ in range(3):  # warm: every decode kernel variant compiled
                engine.step()
            sync(ctx)
            times = []
            for _ in range(3 if ctx.smoke else 20):
                t = time.perf_counter()
                engine.step()
                sync(ctx)
                times.append(time.perf_counter() - t)
            step_ms = 1000 * statistics.median(times)
            launches, syncs = profile_counts(ctx, engine, 3)
            weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
            kv = batch * (context + 30) * kv_bytes_per_block(engine.model, 1, engine.dtype)
            floor_ms = 1000 * (weights + kv) / bw
            ratio = step_ms / floor_ms
            rows.append(row(f"decode step batch {batch} ctx {context} graphs {'on' if graphs else 'off'}",
                            f"{step_ms:.2f} ms = {ratio:.1f}x floor",
                            f"floor {floor_ms:.2f} ms; <= 1.5x at batch 256",
                            (ratio <= 1.5) if batch == 256 else None,
                            f"{launches:.0f} launches, {syncs:.1f} host syncs / step (target <= 1)"))
            del engine
            if not ctx.smoke:
                torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------- (d) engine against transformers CB

def stage_throughput(ctx: Ctx) -> list[dict]:
    import argparse

    from benchmarks import bench_gpu
    # on the CPU transformers' continuous batching sizes its cache from the host's memory (the OOM killer
    # ended the smoke run): the smoke run times the engine alone
    args = argparse.Namespace(smoke=ctx.smoke, requests=2 if ctx.smoke else 64, skip_transformers=ctx.smoke)
    bw = copy_bandwidth(ctx)
    name = model_name(ctx)
    r = bench_gpu.bench_model(name, args, ctx.device, ctx.dtype, bw, checkpoint_dir=checkpoint(ctx, name))
    ours, theirs = r["ours"], r["theirs"]
    rows = [row(f"engine tok/s, bench_gpu workload ({args.requests} requests)", f"{ours.tok_s:,.0f}",
                note=f"decode step {ours.extra['decode_step_ms']:.2f} ms, floor {ours.extra['decode_floor_ms']:.2f}")]
    if theirs.output_tokens:
        ratio = ours.tok_s / theirs.tok_s
        rows.append(row("transformers continuous batching tok/s", f"{theirs.tok_s:,.0f}",
                        "engine >= 5x", None if ctx.smoke else ratio >= 5, f"engine / CB = {ratio:.2f}x"))
    else:
        rows.append(row("transformers continuous batching tok/s", "failed" if theirs.error else "not run",
                        "engine >= 5x", None, theirs.error[:150] or "skipped in the CPU smoke run"))
    return rows


# ---------------------------------------------------------------- (e) tokens against HF generate

@torch.inference_mode()
def hf_greedy(model, prompt: list[int], n: int, device: str) -> list[int]:
    ids = torch.tensor([prompt], device=device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def stage_parity(ctx: Ctx) -> list[dict]:
    from transformers import AutoModelForCausalLM

    from tests.support import tiny_models
    from worker import Engine, SamplingParams

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (5, 17, 40, 63)]
    n_new = 12 if ctx.smoke else 32
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-tiny-") as tmp:
        path = tiny_models.make_tiny_model(tmp, "llama")
        for dtype in ("float32",) if ctx.smoke else ("float32", "bfloat16"):
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(ctx.device).eval()
            want = [hf_greedy(hf, p, n_new, ctx.device) for p in prompts]
            del hf
            # the smoke run keeps to the PyTorch references: building the C++ kernels takes minutes
            engine = Engine(path, device=ctx.device, dtype=dtype, max_num_seqs=8, max_num_batched_tokens=256,
                            kv_cache_gb=0.25, cpu_kernels=not ctx.smoke)
            got = [o.token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=n_new, temperature=0.0,
                                                                                ignore_eos=True))]
            same = sum(a == b for a, b in zip(got, want, strict=True))
            agree = statistics.mean(_prefix_share(a, b) for a, b in zip(got, want, strict=True))
            exact = dtype == "float32"
            rows.append(row(f"tiny llama {dtype} tokens vs HF generate ({ctx.device})",
                            f"{same}/{len(prompts)} identical, {agree:.0%} agreement",
                            "identical" if exact else "agreement rate", (same == len(prompts)) if exact else None))
            del engine
    return rows


def _prefix_share(a: list[int], b: list[int]) -> float:
    n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return n / max(len(b), 1)


STAGES = {
    "a": ("kernels vs reference", stage_kernels, 75),
    "b": ("kernel bandwidth", stage_bandwidth, 60),
    "c": ("decode step vs floor", stage_decode, 120),
    "d": ("engine vs transformers CB", stage_throughput, 150),
    "e": ("tokens vs HF generate", stage_parity, 45),
}
SMOKE_CAPS = {"a": 240, "b": 240, "c": 240, "d": 240, "e": 240}  # a loaded 2-core CI box


def tokenizer_setup() -> None:
    """Point the tiny models' and bench_gpu's tokenizer at the carried copy where the GGUF package is absent."""
    import gpu_env
    from transformers import AutoTokenizer

    from tests.support import tiny_models

    directory = gpu_env.tokenizer_dir()
    tiny_models._tokenizer = lambda: AutoTokenizer.from_pretrained(directory)
