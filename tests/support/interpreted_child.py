"""A test's engine run in a child process under TRITON_INTERPRET=1 (Triton reads it when the kernel modules are
first imported, so the parent, which imported them already, cannot switch): the child is a test module run as
`python -m MODULE ARGS...` that prints one JSON line last."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_interpreted(module: str, *args: str, timeout: float = 900) -> dict:
    """The child's JSON result; fails the test with the child's output tail when it exits non-zero."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"engine child failed:\n{(proc.stdout + proc.stderr)[-6000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])
