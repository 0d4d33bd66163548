"""vLLM's CPU build as one more system of a benchmark's rotation (bench_quant, bench_kv_dtype): the same
requests through its LLM.generate (bench_e2e.run_vllm, inside .venv-vllm; no Redis), and the table line that
sets tokenbus's end-to-end rows against it. Skipped, with the reason in the table, where .venv-vllm is missing
(scripts/setup_vllm_cpu) or vLLM fails."""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def add_vllm_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vllm-python", default=os.path.join(ROOT, ".venv-vllm", "bin", "python"))
    parser.add_argument("--vllm-dtype", default="bfloat16", help="vLLM's weights and activations (its fastest "
                        "setting on an AVX-512 BF16 CPU; float32 is tokenbus's own)")
    parser.add_argument("--no-vllm", action="store_true", help="leave vLLM's row out")


def vllm_turn(args: argparse.Namespace, prompt_ids: list[list[int]], max_tokens: list[int],
              prefix_caching: bool = True) -> Callable[[str], dict | None] | None:
    """A function running vLLM once (its tok/s and load, or None after a failure, kept in args.vllm_skipped),
    or None where vLLM is not to run at all."""
    args.vllm_skipped = "left out (--no-vllm)" if args.no_vllm else ""
    if args.no_vllm:
        return None
    if not os.path.exists(args.vllm_python):
        args.vllm_skipped = f"not installed ({args.vllm_python} is missing: scripts/setup_vllm_cpu)"
        return None
    from benchmarks.e2e.compare import run_vllm
    from worker.engine import loader

    model_dir = loader.resolve("smollm2-135m").directory

    def turn(work: str) -> dict | None:
        load = os.getloadavg()[0]
        got = run_vllm(args.vllm_python, model_dir, prompt_ids, max_tokens, args.threads, work, eager=False,
                       prefix_caching=prefix_caching, dtype=args.vllm_dtype)
        if isinstance(got, str):
            args.vllm_skipped = got
            print(f"vllm skipped: {got}", flush=True)
            return None
        tokens = sum(map(len, got.outputs))
        return {"tok/s": tokens / got.seconds, "load": load, "outputs": got.outputs, **got.extra}

    return turn


def vllm_row(args: argparse.Namespace, runs: list[dict] | None, ours: dict[str, float]) -> str:
    """The paragraph under the table: vLLM's median tok/s and each of `ours` (name: median tok/s) against it."""
    if not runs:
        return f"vLLM's CPU build: {getattr(args, 'vllm_skipped', '') or 'no run'}."
    med = statistics.median(r["tok/s"] for r in runs)
    first = runs[0]
    against = "; ".join(f"{name} / vLLM = **{rate / med:.2f}**" for name, rate in ours.items())
    rounds = ", ".join(f"{r['tok/s']:.1f}" for r in runs)
    loads = ", ".join(f"{r['load']:.1f}" for r in runs)
    return (f"vLLM's CPU build (vllm {first.get('vllm', '?')}, {args.vllm_dtype}, prefix caching on, torch.compile, "
            f"its LLM.generate call, no Redis): median **{med:.1f} tok/s** (rounds {rounds}; load avg {loads}; "
            f"load s {first.get('load s', '?')}). {against}.")
