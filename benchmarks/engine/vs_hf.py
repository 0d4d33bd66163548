"""Engine throughput against the Hugging Face ways of doing the same work, in one run on one workload.

64 chat prompts, output lengths long-tailed 8–256, greedy, EOS ignored, the same torch thread count for
every system. Prints a table and writes it to docs/benchmarks.md (section "engine").

    .venv/bin/python -m benchmarks.engine.vs_hf [--num-prompts 64] [--threads N] [--skip-one-at-a-time]
"""

from __future__ import annotations

import time

import torch

from bench.engine import engine_offline
from bench.harness import agreement, cpu_name, parser
from bench.workload import chat_ids, workload
from benchmarks.harness.docs import write_section
from benchmarks.harness.hf import SystemResult, hf_continuous_batching, hf_one_at_a_time, hf_static_batches


def run_engine(prompt_ids, max_tokens, max_num_seqs: int) -> SystemResult:
    timed = engine_offline(prompt_ids, max_tokens, max_num_seqs=max_num_seqs)
    return SystemResult(f"tokenbus engine (max_num_seqs={max_num_seqs})", timed.seconds, timed.outputs, timed.extra)


def main() -> None:
    ap = parser(__doc__, prompts=64, docs=True, max_num_seqs=64)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--skip-one-at-a-time", action="store_true", help="no baseline run (agreement vs the engine)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    from worker.engine import (
        Engine,  # noqa: F401  (import cost outside the timings)
        loader,
    )

    source = loader.resolve("smollm2-135m")
    tokenizer = loader.load_tokenizer(source)
    model = AutoModelForCausalLM.from_pretrained(source.directory, dtype=torch.float32).eval()
    items = workload(args.num_prompts)
    max_tokens = [m for _, m in items]
    prompt_ids = chat_ids(tokenizer, items)
    print(f"{len(items)} prompts, prompt tokens {sum(map(len, prompt_ids))}, output tokens {sum(max_tokens)}, "
          f"threads {args.threads}", flush=True)

    results: list[SystemResult] = []
    runs = [
        lambda: hf_one_at_a_time(model, prompt_ids, max_tokens),
        lambda: hf_static_batches(model, prompt_ids, max_tokens),
        lambda: hf_continuous_batching(model, prompt_ids, max_tokens),
        lambda: run_engine(prompt_ids, max_tokens, args.max_num_seqs),
    ]
    if args.skip_one_at_a_time:
        runs = runs[1:]
    for run in runs:
        r = run()
        results.append(r)
        print(f"  {r.name}: {r.tokens} tokens in {r.seconds:.1f} s = {r.tokens / r.seconds:.1f} tok/s", flush=True)

    base = results[0]
    lines = [
        f"Workload: {len(items)} chat prompts ({sum(map(len, prompt_ids))} prompt tokens), output lengths "
        f"long-tailed 8–256 ({sum(max_tokens)} tokens), greedy, EOS ignored; SmolLM2-135M fp32 on CPU, "
        f"{args.threads} torch threads, {cpu_name()}; "
        f"run {time.strftime('%Y-%m-%d %H:%M')} with `benchmarks/engine/vs_hf.py`.",
        "",
        f"| system | tok/s | × {'baseline' if not args.skip_one_at_a_time else 'first row'} | "
        "token agreement | identical requests |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in results:
        share, identical = agreement(r.outputs, base.outputs)
        speedup = (r.tokens / r.seconds) / (base.tokens / base.seconds)
        lines.append(f"| {r.name} | {r.tokens / r.seconds:.1f} | {speedup:.2f}× | {share:.1%} "
                     f"| {identical}/{len(items)} |")
    lines.append("")
    lines.append("Token agreement: share of the one-at-a-time baseline's tokens each system reproduces before "
                 "its first divergence (float32 reductions in another order can flip a near-tie).")
    table = "\n".join(lines)
    print()
    print(table)
    if not args.no_write:
        path = write_section("benchmarks.md", "engine", "## Engine throughput (CPU)\n\n" + table)
        print(f"\nwritten to {path}")


if __name__ == "__main__":
    main()
