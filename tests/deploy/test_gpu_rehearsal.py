"""The first GPU run, rehearsed on the CPU (issue #21 items 1, 2 and 7).

`scripts/gpu_check --rehearse` runs every stage's GPU-path imports and its CPU smoke inside a venv that exposes
only what the GPU image holds (gpu_check/image_packages.txt, plus torch/triton/transformers' own
dependencies), after installing the carry (.whl/, scripts/gpu_check_wheels) the way the GPU run does. The stage
runner keeps every row measured before a stage overruns and kills the stage's whole process group.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from gpu_check import carry as gpu_carry

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def carry() -> Path:
    """The carry as scripts/gpu_check_wheels builds it (downloaded once when absent or unfit)."""
    directory = ROOT / ".whl"
    if gpu_carry.check(directory) or not (directory / "rehearse").is_dir():
        proc = subprocess.run([str(ROOT / "scripts" / "gpu_check_wheels")], cwd=ROOT, capture_output=True,
                              text=True, timeout=600, env=dict(os.environ, PYTHON=sys.executable))
        assert proc.returncode == 0, proc.stderr[-2000:]
    assert gpu_carry.check(directory) == []
    return directory


def test_the_image_venv_lacks_what_the_carry_brings(tmp_path):
    python = gpu_carry.make_venv(tmp_path / "venv")
    # find_spec, not import: the same answer without seconds of torch import (the rehearsal imports them all)
    probe = ("import importlib.util\n"
             "for m in ('torch', 'triton', 'transformers', 'structlog', 'pydantic', 'redis', 'llguidance', 'gguf',"
             " 'worker'):\n"
             "    print(m, 'ok' if importlib.util.find_spec(m) else 'missing')\n")
    proc = subprocess.run([str(python), "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")})
    seen = dict(line.split() for line in proc.stdout.splitlines())
    assert seen == {"torch": "ok", "triton": "ok", "transformers": "ok", "structlog": "missing",
                    "pydantic": "missing", "redis": "missing", "llguidance": "missing", "gguf": "missing",
                    "worker": "missing"}, proc.stdout + proc.stderr[-2000:]


def test_carry_check_names_a_missing_and_a_foreign_wheel(carry, tmp_path):
    for w in carry.glob("*.whl"):
        if not w.name.startswith("llguidance"):
            shutil.copy(w, tmp_path)
    foreign = tmp_path / "extra-1.0-cp313-cp313-manylinux_2_17_x86_64.whl"
    with zipfile.ZipFile(foreign, "w") as z:
        z.writestr("extra-1.0.dist-info/METADATA", "Name: extra\nVersion: 1.0\nRequires-Dist: nowhere-pkg\n")
    problems = " | ".join(gpu_carry.check(tmp_path))
    assert "llguidance is not carried" in problems
    assert f"{foreign.name} does not install on CPython 3.12" in problems
    assert "needs nowhere-pkg" in problems


def test_a_stage_over_its_cap_is_killed_whole_and_its_rows_stay(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    env = dict(os.environ, OUT=str(tmp_path / "out"), PYTHON=sys.executable, GPU_CHECK_SELFTEST_PID=str(pid_file))
    proc = subprocess.run([str(ROOT / "scripts" / "gpu_check"), "--cpu-smoke", "--stages", "z"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads((tmp_path / "out" / "gpu_check.json").read_text())["rows"]
    assert [r["value"] for r in rows] == ["kept", "OVERRAN 8s cap (process group killed)"]
    md = (tmp_path / "out" / "gpu_check.md").read_text()
    assert "| z | self-test row measured before the overrun | kept |" in md and "Misses: 1." in md
    grandchild = int(pid_file.read_text())
    assert not Path(f"/proc/{grandchild}").exists() or "Z" in Path(f"/proc/{grandchild}/stat").read_text().split()[2]


@pytest.mark.slow
def test_rehearsal_runs_every_stage_inside_the_image_venv(carry, tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable, HF_HUB_OFFLINE="1")
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([str(ROOT / "scripts" / "gpu_check"), "--rehearse"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["smoke"] is True and report["rehearsal"] is True
    assert report["environment"]["device"] == "CPU smoke run"
    assert set(report["stage_seconds"]) == set("abcdekmqlsv")  # the rehearsal runs the opt-in stages too
    rows = report["rows"]
    failed = [r for r in rows if r["ok"] is False]
    assert not failed, failed  # no stage overran, failed, missed an import or a target the CPU can check
    imports = [r for r in rows if r["check"].endswith("GPU-path imports")]
    assert [r["stage"] for r in imports] == list("abcdekmqlsv") and all(r["ok"] for r in imports)
    checks = " ".join(r["check"] for r in rows)
    for expected in ("vs reference", "collects", "decode attention", "decode step", "host syncs",
                     "continuous batching", "HF generate", "padded static decode vs eager", "LoRA adapters change",
                     "cascade forced on vs off", "all-MiniLM-L6-v2 vectors", "decoder embedder"):
        assert expected in checks, f"no {expected!r} row: {checks}"
    assert all(r["ok"] for r in rows if "HF generate" in r["check"] or "vs eager" in r["check"])
    assert any("real weights" in r["note"] for r in rows if "all-MiniLM" in r["check"]), "MiniLM was not carried"
    md = (tmp_path / "gpu_check.md").read_text()
    assert md.startswith("# GPU check (CPU smoke run") and md.count("\n| ") == len(rows) + 1
    assert "`scripts/gpu_check --rehearse`" in md and "| stage | check | result |" in proc.stdout
