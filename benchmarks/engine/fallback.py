"""The transformers fallback against tokenbus's own model code, on the same model in the same run (CPU).

SmolLM2-135M (a Llama) served twice by Engine.generate, offline: model_impl "native" (models/llama.py with
the C++ kernels, fused decode layers and panel linears) and model_impl "transformers" (transformers' own
LlamaForCausalLM with tokenbus's paged cache and C++ attention through AttentionInterface). Rounds alternate
native / fallback so machine noise falls on both; the table gives each round and the median ratio, and how
many requests' greedy tokens agree. Writes docs/bench_fallback.md.

    .venv/bin/python -m benchmarks.engine.fallback [--num-prompts 32] [--max-tokens 64] [--rounds 2]
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from bench.harness import parser

TOPICS = ["tides", "volcanoes", "bread", "bridges", "bees", "glaciers", "chess", "compilers", "rainbows", "maps",
          "ink", "lighthouses", "coral", "clocks", "paper", "salt"]
DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs")


def run(model_impl: str, prompts: list[str], max_tokens: int, max_num_seqs: int) -> tuple[float, list[list[int]]]:
    """(generated tokens per second, each request's tokens) for one engine built with model_impl."""
    from worker import Engine, SamplingParams

    engine = Engine("smollm2-135m", device="cpu", dtype="float32", max_num_seqs=max_num_seqs,
                    max_num_batched_tokens=512, model_impl=model_impl)
    engine.generate([prompts[0]], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outs) / seconds, [o.token_ids for o in outs]


def main() -> None:
    args = parser(__doc__, docs=True, prompts=32, max_tokens=64, rounds=2).parse_args()
    prompts = [f"Explain how {TOPICS[i % len(TOPICS)]} work, in three short paragraphs for a child."
               for i in range(args.num_prompts)]
    rows, ratios, agree = [], [], []
    for r in range(args.rounds):
        native, native_tokens = run("native", prompts, args.max_tokens, args.num_prompts)
        fallback, fallback_tokens = run("transformers", prompts, args.max_tokens, args.num_prompts)
        ratios.append(fallback / native)
        agree.append(sum(a == b for a, b in zip(native_tokens, fallback_tokens, strict=True)))
        rows.append(f"| {r + 1} | {native:,.1f} | {fallback:,.1f} | {fallback / native:.2f}x | "
                    f"{agree[-1]}/{len(prompts)} |")
        print(rows[-1], flush=True)
    body = "\n".join([
        f"{args.num_prompts} prompts x {args.max_tokens} tokens (greedy, EOS ignored), SmolLM2-135M float32, "
        f"CPU ({os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads), "
        "Engine.generate offline, max_num_seqs = the prompt count; rounds alternate native / fallback.",
        "",
        "| round | native tok/s | transformers fallback tok/s | fallback / native | same greedy tokens |",
        "|---|---|---|---|---|",
        *rows,
        "",
        f"Median fallback / native: **{statistics.median(ratios):.2f}x** (goal: >= 0.7x on the CPU).",
    ])
    print(body)
    if not args.no_write:
        path = os.path.join(DOCS, "bench_fallback.md")
        with open(path, "w") as f:
            f.write("# Transformers fallback vs native model code\n\n"
                    "Written by `python -m benchmarks.engine.fallback`.\n\n" + body + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
