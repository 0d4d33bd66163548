"""scripts/gpu_check without a GPU says so, and the gpu_check package's modules import without the packages the
carry brings. The smoke run of every stage runs inside the rehearsal (tests/deploy/test_gpu_rehearsal.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


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
        "        if name.split('.')[0] in ('structlog', 'pydantic', 'pydantic_core', 'redis', 'llguidance'):\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "from gpu_check import carry, engine_bench, env, fp8, graphs, kernel_bench, kv, measure, report, runner\n"
        "from gpu_check import stages\n"
        "assert env.missing() == ['structlog', 'pydantic', 'redis', 'llguidance'], env.missing()\n"
        "print('imported')\n"
    )
    proc = subprocess.run([sys.executable, "-c", blocker], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "imported" in proc.stdout, proc.stderr[-2000:]


def test_the_stage_caps_docs_gpu_md_states_are_the_stages_own():
    # docs/gpu.md sizes the run calls (timeout_s) by these sums: a cap raised in the code must show there
    from gpu_check import stages
    caps = {key: cap for key, (_, _, cap) in (stages.STAGES | stages.HIDDEN_STAGES).items()}
    doc = (ROOT / "docs" / "gpu.md").read_text()
    assert f"five stages whose caps sum to {sum(caps[k] for k in 'abcde')} s" in doc
    assert f"the three opt-in stages (k, m, q: {sum(caps[k] for k in 'kmq')} s)" in doc
