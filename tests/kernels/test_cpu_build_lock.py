"""A CPU-kernel build killed half-way (SIGKILL) leaves torch's baton file behind; the next engine still builds
the kernels and serves instead of waiting forever (tokenbus_kernels/cpu.py build_lock)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_an_engine_killed_mid_build_does_not_block_the_next(tmp_path, serve_model_dir):
    cache = tmp_path / "cache"
    env = {**os.environ, "TOKENBUS_CACHE_DIR": str(cache)}
    engine = ("import sys; from worker import Engine, SamplingParams; "
              f"e = Engine({serve_model_dir!r}, device='cpu', dtype='float32', kv_cache_gb=0.05); "
              "out = e.generate(['hello'], SamplingParams(max_tokens=3, ignore_eos=True))[0]; "
              "print('BACKEND', e.backend.name, 'TOKENS', len(out.token_ids))")
    first = subprocess.Popen([sys.executable, "-c", engine], cwd=ROOT, env=env, start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not list(cache.glob("cpu_kernels/*/lock")):  # torch's baton: the compiler is running
        assert first.poll() is None, "the first engine ended before its build started"
        assert time.monotonic() < deadline, "the first engine never started building"
        time.sleep(0.05)
    os.killpg(first.pid, signal.SIGKILL)  # the engine and its compiler, mid-build
    first.wait(30)
    assert list(cache.glob("cpu_kernels/*/lock")), "the killed build left no baton: this test shows nothing"
    assert not list(cache.glob("cpu_kernels/*/*.so"))

    second = subprocess.run([sys.executable, "-c", engine], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "BACKEND cpu-cpp TOKENS 3" in second.stdout, second.stdout + second.stderr[-2000:]
