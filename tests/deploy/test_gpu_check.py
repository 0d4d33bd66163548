"""scripts/gpu_check --cpu-smoke: every stage runs on tiny CPU shapes (kernels under TRITON_INTERPRET=1) and the
table, gpu_check.md and gpu_check.json land under $OUT, so the GPU command stays runnable without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_smoke_runs_every_stage_and_writes_the_files(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable, HF_HUB_OFFLINE="1")
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([str(ROOT / "scripts" / "gpu_check"), "--cpu-smoke"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["smoke"] is True and set(report["stage_seconds"]) == set("abcde")
    rows = report["rows"]
    assert {r["stage"] for r in rows} == set("abcde")
    failed = [r for r in rows if r["ok"] is False]
    assert not failed, failed  # no stage overran, failed, or missed a target the CPU can check
    checks = " ".join(r["check"] for r in rows)
    for expected in ("vs reference", "decode attention", "decode step", "continuous batching", "HF generate"):
        assert expected in checks, f"no {expected!r} row: {checks}"
    parity = next(r for r in rows if "HF generate" in r["check"])
    assert parity["ok"] is True, parity  # float32 tokens identical to HF generate
    md = (tmp_path / "gpu_check.md").read_text()
    assert md.startswith("# GPU check (CPU smoke run") and md.count("\n| ") == len(rows) + 1
    assert "| stage | check | result |" in proc.stdout


def test_gpu_check_without_a_gpu_says_so(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    proc = subprocess.run([str(ROOT / "scripts" / "gpu_check"), "--stages", "a"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    import torch

    if torch.cuda.is_available():
        return
    assert proc.returncode == 2 and "no CUDA device" in proc.stderr
    assert not (tmp_path / "gpu_check.json").exists()


def test_bench_scripts_import_without_structlog_pydantic_or_redis():
    # the GPU image has none of the three: the scripts must get as far as their own code (and then install
    # the carried wheels) instead of dying on an import
    blocker = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('structlog', 'pydantic', 'pydantic_core', 'redis'):\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        f"sys.path.insert(0, {str(ROOT / 'scripts')!r})\n"
        "import bench_gpu, bench_kernels, gpu_check, gpu_check_stages, gpu_env\n"
        "assert gpu_env.missing() == ['structlog', 'pydantic', 'redis'], gpu_env.missing()\n"
        "print('imported')\n"
    )
    proc = subprocess.run([sys.executable, "-c", blocker], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "imported" in proc.stdout, proc.stderr[-2000:]
