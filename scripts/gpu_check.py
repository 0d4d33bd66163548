"""One check of the GPU serving path on a lent GPU (run through `scripts/gpu_check`; docs/gpu.md).

Runs the stages of scripts/gpu_check_stages.py, each in its own process under its own time cap (a stage that
overruns or fails is a row saying so, and the next stage runs), then prints one table and writes
gpu_check.md and gpu_check.json under $OUT (./gpu-check-out when OUT is unset).

    scripts/gpu_check                 # CUDA: stages a-e, about 8 minutes at most
    scripts/gpu_check --cpu-smoke     # no GPU: the same stages on tiny shapes, kernels under TRITON_INTERPRET=1
    scripts/gpu_check --stages a,e    # a subset
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


def run_stage_here(key: str, smoke: bool, rows_file: str) -> int:
    """Child process: one stage, its rows written as JSON."""
    if smoke and key in "ab":
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernels module defines its @triton.jit functions
    elif smoke:
        os.environ.pop("TRITON_INTERPRET", None)  # a CPU engine on the interpreter: minutes a step
    import gpu_env

    gpu_env.ensure_engine_deps()
    import gpu_check_stages as stages

    if key in "cde":  # the stages that build models (transformers' import alone is seconds)
        stages.tokenizer_setup()
    rows = stages.STAGES[key][1](stages.Ctx(smoke=smoke))
    Path(rows_file).write_text(json.dumps(rows))
    return 0


def run_stage(key: str, name: str, cap: float, smoke: bool) -> tuple[list[dict], float]:
    """One stage in a child process, killed at its cap. Returns its rows (or one row saying what went wrong)."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        rows_file = f.name
    cmd = [sys.executable, str(Path(__file__).resolve()), "--run-stage", key, "--rows-file", rows_file]
    cmd += ["--cpu-smoke"] if smoke else []
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=cap)
        seconds = time.perf_counter() - started
        out = Path(rows_file).read_text() if proc.returncode == 0 else ""
        if proc.returncode != 0 or not out:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            return [dict(check=f"stage {key} ({name})", value="FAILED", reference="", ok=False,
                         note=" | ".join(tail)[-300:])], seconds
        rows = json.loads(out)
    except subprocess.TimeoutExpired as err:
        seconds = time.perf_counter() - started
        tail = (err.stdout or b"")[-200:]
        tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        return [dict(check=f"stage {key} ({name})", value=f"OVERRAN {cap:.0f}s cap", reference="", ok=False,
                     note=tail.replace("\n", " ").strip())], seconds
    finally:
        Path(rows_file).unlink(missing_ok=True)
    return rows, seconds


def verdict(ok) -> str:
    return {True: "ok", False: "MISS", None: "-"}[ok]


def table(results: list[dict]) -> list[str]:
    lines = ["| stage | check | result | target / reference | ok | note |", "|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['stage']} | {r['check']} | {r['value']} | {r['reference']} | {verdict(r['ok'])} | "
                     f"{r['note'].replace('|', '/')} |")
    return lines


def environment(smoke: bool) -> dict:
    import torch
    import transformers
    import triton

    device = "CPU smoke run" if smoke else torch.cuda.get_device_name(0)
    return dict(device=device, torch=torch.__version__, triton=triton.__version__,
                transformers=transformers.__version__, python=sys.version.split()[0],
                when=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (no GPU needed)")
    ap.add_argument("--stages", default="a,b,c,d,e", help="comma-separated subset of a,b,c,d,e")
    ap.add_argument("--run-stage", help=argparse.SUPPRESS)
    ap.add_argument("--rows-file", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.run_stage:
        return run_stage_here(args.run_stage, args.cpu_smoke, args.rows_file)

    import gpu_check_stages as stages

    keys = [k.strip() for k in args.stages.split(",") if k.strip()]
    unknown = [k for k in keys if k not in stages.STAGES]
    if unknown:
        ap.error(f"unknown stage(s) {unknown}; stages are {list(stages.STAGES)}")
    import torch

    if not args.cpu_smoke and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); nothing was measured.\n"
              "Run it on a lent GPU (docs/gpu.md), or use --cpu-smoke on the CPU.", file=sys.stderr)
        return 2
    out_dir = Path(os.environ.get("OUT") or "gpu-check-out")
    out_dir.mkdir(parents=True, exist_ok=True)
    env = environment(args.cpu_smoke)
    print(f"gpu_check on {env['device']}: torch {env['torch']}, triton {env['triton']}, "
          f"transformers {env['transformers']}", flush=True)
    results, stage_times = [], {}
    cache = tempfile.mkdtemp(prefix="gpu-check-")  # checkpoints the stages share
    os.environ["GPU_CHECK_CACHE"] = cache
    for key in keys:
        name, _, cap = stages.STAGES[key]
        cap = stages.SMOKE_CAPS[key] if args.cpu_smoke else cap
        print(f"[{key}] {name} (cap {cap}s) ...", flush=True)
        rows, seconds = run_stage(key, name, cap, args.cpu_smoke)
        stage_times[key] = round(seconds, 1)
        for r in rows:
            results.append(dict(stage=key, **r))
            print(f"    {verdict(r['ok']):4s} {r['check']}: {r['value']}  {r['note']}", flush=True)
        print(f"[{key}] {seconds:.0f}s", flush=True)
    shutil.rmtree(cache, ignore_errors=True)

    lines = table(results)
    misses = sum(r["ok"] is False for r in results)
    title = "# GPU check" + (" (CPU smoke run: no GPU numbers)" if args.cpu_smoke else "")
    md = [title, "", f"{env['device']}; torch {env['torch']}, triton {env['triton']}, transformers "
          f"{env['transformers']}, Python {env['python']}; {env['when']}; `scripts/gpu_check"
          f"{' --cpu-smoke' if args.cpu_smoke else ''}`. Stage seconds: "
          + ", ".join(f"{k} {v}" for k, v in stage_times.items()) + f". Misses: {misses}.", "", *lines, ""]
    (out_dir / "gpu_check.md").write_text("\n".join(md))
    (out_dir / "gpu_check.json").write_text(json.dumps(
        dict(environment=env, smoke=args.cpu_smoke, stage_seconds=stage_times, rows=results), indent=1))
    print("\n" + "\n".join(lines))
    print(f"\n{misses} miss(es); wrote {out_dir}/gpu_check.md and gpu_check.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
