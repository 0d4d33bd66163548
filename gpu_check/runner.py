"""One check of the GPU serving path on a lent GPU (run through `scripts/gpu_check`; docs/gpu.md).

Runs the stages of gpu_check/stages.py one after another, each in its own process group under its own
time cap: at the cap the whole group (the stage and anything it started, a pytest run on the GPU say) is
killed, a row says so, and the next stage runs. Each row is appended to gpu_check.md and gpu_check.json under
$OUT (./gpu-check-out when OUT is unset) the moment it is measured; the stages' output goes to
gpu_check_stages.log beside them.

    scripts/gpu_check                 # CUDA: stages a-e, caps summing to 460 s (one 570 s run call)
    scripts/gpu_check --stages k,m,q  # CUDA, a second call: the opt-in stages, caps summing to 230 s
    scripts/gpu_check --stages l,s,v  # CUDA, a third call: LoRA and cascade under graphs, embeddings (300 s)
    scripts/gpu_check --cpu-smoke     # no GPU: the same stages on tiny shapes, kernels under TRITON_INTERPRET=1
    scripts/gpu_check --rehearse      # no GPU: the smoke run of every stage (opt-in ones too) inside a venv
                                      # holding only what the GPU image holds, after installing the carry
                                      # (.whl/) as the GPU run does
    scripts/gpu_check --stages a,e    # a subset
    (k: fp8 KV cache, m: fused MoE, q: FP8 weights; l: LoRA and s: cascade under CUDA graphs, v: embeddings;
    opt-in so the default run's caps stay within 8 minutes)
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpu_check.report import Report, md_line, verdict

ROOT = Path(__file__).resolve().parent.parent


def run_stage_here(key: str, smoke: bool, rehearsal: bool, out_dir: str) -> int:
    """Child process: one stage; its rows appended to the report as they are measured."""
    if smoke and key in "abkm":  # k, m: the fp8 KV cache and fused MoE are Triton kernels (the interpreter)
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernels module defines its @triton.jit functions
    elif smoke:
        os.environ.pop("TRITON_INTERPRET", None)  # a CPU engine on the interpreter: minutes a step
    from gpu_check import env as gpu_env

    gpu_env.ensure_engine_deps()
    from gpu_check import stages

    report = Report(out_dir)

    def emit(row: dict) -> None:
        print(f"    {verdict(row['ok']):4s} {row['check']}: {row['value']}  {row['note']}", flush=True)
        report.add(key, row)

    ctx = stages.Ctx(smoke=smoke, rehearsal=rehearsal, emit=emit)
    if rehearsal:
        stages.check_imports(key, ctx)
    if key in "cdekqlsv":  # the stages that build models (transformers' import alone is seconds)
        stages.tokenizer_setup()
    (stages.STAGES | stages.HIDDEN_STAGES)[key][1](ctx)
    return 0


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_stage(key: str, name: str, cap: float, args, report: Report, log_path: Path) -> float:
    """One stage in its own process group, killed whole at its cap; a failure or an overrun becomes a row."""
    cmd = [sys.executable, "-m", "gpu_check", "--run-stage", key, "--out", str(report.dir)]
    cmd += (["--cpu-smoke"] if args.cpu_smoke else []) + (["--rehearsal"] if args.rehearsal else [])
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    started = time.perf_counter()
    with log_path.open("a") as log:
        log.write(f"\n===== stage {key} ({name}), cap {cap:.0f}s\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=cap)
            overran = False
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid)
            rc, overran = proc.wait(), True
        finally:
            _kill_group(proc.pid)  # what the stage left running (a pytest on the GPU) goes with it
    seconds = time.perf_counter() - started
    if overran or rc != 0:
        tail = " | ".join(log_path.read_text().strip().splitlines()[-3:])[-300:]
        value = f"OVERRAN {cap:.0f}s cap (process group killed)" if overran else f"FAILED (exit {rc})"
        report.add(key, dict(check=f"stage {key} ({name})", value=value, reference="", ok=False, note=tail))
    report.stage_done(key, seconds)
    for r in report.load()["rows"]:
        if r["stage"] == key:
            print(f"    {verdict(r['ok']):4s} {r['check']}: {r['value']}  {r['note']}", flush=True)
    return seconds


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def environment(smoke: bool) -> dict:
    from importlib.metadata import version  # not `import transformers`: seconds, and the stages import it

    if smoke:
        device = "CPU smoke run"
    else:
        import torch

        device = torch.cuda.get_device_name(0)
    return dict(device=device, torch=version("torch"), triton=version("triton"),
                transformers=version("transformers"), python=sys.version.split()[0],
                when=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))


DEFAULT_STAGES = "a,b,c,d,e"  # caps 460 s: one run call of 570 s with a cold Triton cache
OPT_IN_STAGES = "k,m,q"  # caps 230 s: a second call (fp8 KV cache, fused MoE, FP8 weights)
SERVING_STAGES = "l,s,v"  # caps 300 s: a third call (LoRA and cascade under CUDA graphs, embeddings)


def rehearse(args) -> int:
    """Builds the rehearsal (a venv exposing only the image's distributions, the carry as the GPU run installs
    it) in a temporary folder and runs the smoke run inside it."""
    from gpu_check import carry as gpu_carry

    carry = ROOT / ".whl"
    problems = gpu_carry.check(carry)
    if problems:
        print("gpu_check --rehearse: the carry is not fit to travel:\n  " + "\n  ".join(problems)
              + "\nrun scripts/gpu_check_wheels first", file=sys.stderr)
        return 1
    tmp = Path(tempfile.mkdtemp(prefix="gpu-rehearse-"))
    try:
        started = time.perf_counter()
        python = gpu_carry.make_venv(tmp / "venv")
        wheels = gpu_carry.rehearsal_wheels(carry, tmp / "wheels")
        print(f"rehearsal venv {tmp / 'venv'} ready in {time.perf_counter() - started:.1f}s", flush=True)
        env = dict(os.environ, TOKENBUS_GPU_WHEELS=str(wheels), TOKENBUS_GPU_SITE=str(tmp / "site"))
        for var in ("PYTHONPATH", "VIRTUAL_ENV", "TRITON_INTERPRET"):
            env.pop(var, None)
        cmd = [str(python), "-m", "gpu_check", "--cpu-smoke", "--rehearsal", "--stages", args.stages]
        return subprocess.run(cmd, cwd=ROOT, env=env).returncode
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (no GPU needed)")
    ap.add_argument("--rehearse", action="store_true", help="the smoke run in a venv of the GPU image's packages")
    ap.add_argument("--stages", default=None,
                    help=f"comma-separated stages (default {DEFAULT_STAGES}; opt-in: {OPT_IN_STAGES} and "
                         f"{SERVING_STAGES}; "
                         "--rehearse: all of them)")
    ap.add_argument("--rehearsal", action="store_true", help=argparse.SUPPRESS)  # inside the rehearsal venv
    ap.add_argument("--run-stage", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.stages is None:  # the rehearsal proves every stage, opt-in ones too, imports and runs in the image
        args.stages = f"{DEFAULT_STAGES},{OPT_IN_STAGES},{SERVING_STAGES}" if args.rehearse else DEFAULT_STAGES
    if args.run_stage:
        return run_stage_here(args.run_stage, args.cpu_smoke, args.rehearsal, args.out)
    if args.rehearse:
        return rehearse(args)

    from gpu_check import stages

    keys = [k.strip() for k in args.stages.split(",") if k.strip()]
    known = stages.STAGES | stages.HIDDEN_STAGES
    unknown = [k for k in keys if k not in known]
    if unknown:
        ap.error(f"unknown stage(s) {unknown}; stages are {list(stages.STAGES)}")
    if not args.cpu_smoke and not _cuda_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); nothing was measured.\n"
              "Run it on a lent GPU (docs/gpu.md), or use --cpu-smoke / --rehearse on the CPU.", file=sys.stderr)
        return 2
    out_dir = Path(os.environ.get("OUT") or "gpu-check-out")
    env = environment(args.cpu_smoke)
    print(f"gpu_check on {env['device']}: torch {env['torch']}, triton {env['triton']}, "
          f"transformers {env['transformers']}", flush=True)
    command = "scripts/gpu_check" + (" --rehearse" if args.rehearsal else " --cpu-smoke" if args.cpu_smoke else "")
    title = "# GPU check" + (" (CPU smoke run: no GPU numbers)" if args.cpu_smoke else "")
    summary = (f"{env['device']}; torch {env['torch']}, triton {env['triton']}, transformers "
               f"{env['transformers']}, Python {env['python']}; {env['when']}; `{command}`.")
    report = Report(out_dir)
    report.start(title, summary, env, args.cpu_smoke, args.rehearsal)
    log_path = out_dir / "gpu_check_stages.log"
    log_path.write_text("")
    cache = tempfile.mkdtemp(prefix="gpu-check-")  # checkpoints the stages share
    os.environ["GPU_CHECK_CACHE"] = cache
    try:
        for key in keys:
            name, _, cap = known[key]
            cap = stages.SMOKE_CAPS[key] if args.cpu_smoke else cap
            print(f"[{key}] {name} (cap {cap}s) ...", flush=True)
            seconds = run_stage(key, name, cap, args, report, log_path)
            print(f"[{key}] {seconds:.0f}s", flush=True)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    data, misses = report.finish()
    print("\n" + "\n".join(["| stage | check | result | target / reference | ok | note |",
                            "|---|---|---|---|---|---|", *map(md_line, data["rows"])]))
    print(f"\n{misses} miss(es); wrote {out_dir}/gpu_check.md, gpu_check.json and gpu_check_stages.log")
    return 0

