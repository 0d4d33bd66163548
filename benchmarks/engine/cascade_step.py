"""Where a decode step goes behind a shared system prompt, plain decode against cascade attention (#39): the
KV bytes decode attention reads per step (the offline engine's counters, EngineStats.decode_kv_tokens_*)
and the attention's share of the step (the C++ decode kernels timed on a step of the same shape, over a
cold cache per layer, against the engine's mean step time). Run by benchmarks/e2e/cascade.py; alone:

    python -m benchmarks.engine.cascade_step --num-prompts 64 --rules 14
"""

from __future__ import annotations

import statistics
import time

import torch

from bench.harness import parser
from bench.workload import chat_ids, shared_prefix_workload
from tokenbus_kernels.cascade import CascadeLayout
from tokenbus_kernels.kv_quant import bytes_per_token

DEFAULT_MODEL = "smollm2-135m"


def engine_run(model: str, prompt_ids: list[list[int]], max_tokens: list[int], cascade: str, threads: int,
               **options) -> dict:
    """The offline engine over the requests: its mean step time, decode KV bytes read per step."""
    from worker import Engine, SamplingParams

    torch.set_num_threads(threads)
    engine = Engine(model, device="cpu", dtype="float32", max_num_seqs=64, max_num_batched_tokens=512,
                    cascade_attention=cascade, **options)
    engine.generate([prompt_ids[0]], SamplingParams(max_tokens=2, temperature=0.0))  # warm: the prefix cached
    before = engine.stats()
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]
    started = time.perf_counter()
    engine.generate(prompt_ids, params)
    seconds = time.perf_counter() - started
    after = engine.stats()
    arch = engine.model.arch
    per_token = bytes_per_token(arch.num_layers, arch.num_kv_heads, arch.head_dim, engine.kv_dtype)
    steps = after.steps - before.steps
    read = after.decode_kv_tokens_read - before.decode_kv_tokens_read
    plain = after.decode_kv_tokens_plain - before.decode_kv_tokens_plain
    return {"cascade": cascade, "steps": steps, "step ms": 1000 * seconds / max(1, steps),
            "tok/s": sum(max_tokens) / seconds, "kv MB read per step": read * per_token / max(1, steps) / 1e6,
            "kv MB per step, plain decode": plain * per_token / max(1, steps) / 1e6,
            "cascaded steps": after.cascade_steps - before.cascade_steps,
            "layers": arch.num_layers, "shape": (arch.num_heads, arch.num_kv_heads, arch.head_dim)}


def attention_ms(rows: int, prefix: int, suffix: int, shape: tuple[int, int, int], layers: int,
                 repeats: int = 5) -> dict[str, float]:
    """ms per step of decode attention over `layers` cold caches, rows behind one shared prefix: plain decode
    and cascade (the C++ kernels; the median of `repeats`)."""
    from tokenbus_kernels.cpu import extension

    ext = extension()
    if ext is None:
        raise RuntimeError("the C++ kernels did not build here")
    hq, hk, d = shape
    bs = 16
    prefix_blocks, own_blocks = prefix // bs, -(-suffix // bs) + 1
    num_blocks = prefix_blocks + rows * own_blocks
    table = torch.zeros(rows, prefix_blocks + own_blocks, dtype=torch.int32)
    for r in range(rows):
        table[r, :prefix_blocks] = torch.arange(prefix_blocks)
        table[r, prefix_blocks:] = prefix_blocks + r * own_blocks + torch.arange(own_blocks)
    lens = torch.full((rows,), prefix_blocks * bs + suffix, dtype=torch.int32)
    caches = [(torch.randn(num_blocks, bs, hk, d), torch.randn(num_blocks, bs, hk, d)) for _ in range(layers)]
    q = torch.randn(rows, hq, d)
    layout = CascadeLayout.build([(list(range(rows)), prefix_blocks * bs)], rows)
    lay = (layout.group_rows, layout.group_starts, layout.prefix_lens, layout.suffix_starts)
    calls = {
        "plain": lambda k, v: ext.paged_decode_attention_cpu(q, k, v, table, lens, d**-0.5, 0, 0.0),
        "cascade": lambda k, v: ext.cascade_decode_attention_cpu(q, k, v, table, lens, *lay, d**-0.5, 0, 0.0),
    }
    out = {}
    for name, call in calls.items():
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            for k, v in caches:
                call(k, v)
            times.append(1000 * (time.perf_counter() - started))
        out[name] = statistics.median(times)
    return out


def step_report(model: str, prompt_ids: list[list[int]], max_tokens: list[int], threads: int) -> list[str]:
    """The section's lines: per mode, step time, KV MB per step; the attention's ms and share of the step."""
    import os

    runs = [engine_run(model, prompt_ids, max_tokens, mode, threads) for mode in ("off", "auto")]
    prefix = len(os.path.commonprefix(prompt_ids))
    suffix = statistics.median(len(p) - prefix for p in prompt_ids) + statistics.median(max_tokens) // 2
    att = attention_ms(min(64, len(prompt_ids)), prefix, int(suffix), runs[0]["shape"], runs[0]["layers"])
    lines = ["| cascade | steps | ms per step | KV MB read per step | plain decode would read | "
             "attention ms per step (kernels alone) | attention share of the step |", "|---|---|---|---|---|---|---|"]
    for run, kernel in zip(runs, ("plain", "cascade"), strict=True):
        lines.append(f"| {run['cascade']} | {run['steps']} | {run['step ms']:.1f} | {run['kv MB read per step']:.1f} | "
                     f"{run['kv MB per step, plain decode']:.1f} | {att[kernel]:.1f} ({kernel}) | "
                     f"{att[kernel] / run['step ms']:.0%} |")
    lines.append(f"(attention timed on {min(64, len(prompt_ids))} rows behind {prefix // 16 * 16} shared tokens "
                 f"+ {int(suffix)} own, {runs[0]['layers']} layers each with its own cold cache; cascaded steps "
                 f"with auto: {runs[1]['cascaded steps']} of {runs[1]['steps']})")
    return lines


def main() -> None:
    ap = parser(__doc__, model=DEFAULT_MODEL, prompts=64, max_tokens=64, threads=2, rules=14)
    args = ap.parse_args()
    from worker.engine.loader import load_tokenizer, resolve

    tokenizer = load_tokenizer(resolve(args.model))
    work = shared_prefix_workload(args.num_prompts, max_tokens=args.max_tokens, rules=args.rules)
    print("\n".join(step_report(args.model, chat_ids(tokenizer, work), [m for _, m in work], args.threads)))


if __name__ == "__main__":
    main()
