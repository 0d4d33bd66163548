"""A CPU-kernel build killed half-way (SIGKILL) leaves torch's baton file behind; the next process still builds
and loads the module instead of waiting forever (tokenbus_kernels/cpu.py build_once and build_lock).

The processes build a one-function C extension through build_once, the code extension() builds the kernels
with, under the same lock and the same torch cpp_extension build with its baton: what is tested is the lock,
and the kernels' own build (a minute of g++ on a fresh cache) would add nothing but time. The killed build's
compiler is made to take its time (a wrapper that sleeps before it runs g++), so the kill always lands while
the compiler runs; the build after it uses g++ as it is. Every engine test loads the real kernels through the
same build_once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NAME = "tokenbus_lock_probe"
SOURCE = f"""#include <Python.h>
static PyObject* answer(PyObject*, PyObject*) {{ return PyLong_FromLong(42); }}
static PyMethodDef methods[] = {{{{"answer", answer, METH_NOARGS, nullptr}}, {{nullptr, nullptr, 0, nullptr}}}};
static struct PyModuleDef module = {{PyModuleDef_HEAD_INIT, "{NAME}", nullptr, -1, methods}};
PyMODINIT_FUNC PyInit_{NAME}() {{ return PyModule_Create(&module); }}
"""
BUILD = ("import sys\n"
         "from pathlib import Path\n"
         "from torch.utils.cpp_extension import load\n"
         "from tokenbus_kernels.cpu import build_once\n"
         "src, build_dir = sys.argv[1], Path(sys.argv[2])\n"
         f"m = build_once({NAME!r}, build_dir, lambda: load({NAME!r}, sources=[src], build_directory=str(build_dir)))\n"
         "print('ANSWER', m.answer())\n")


def test_a_build_killed_mid_compile_does_not_block_the_next(tmp_path):
    src = tmp_path / "probe.cpp"
    src.write_text(SOURCE)
    build_dir = tmp_path / "cache" / "cpu_kernels" / NAME
    slow_cxx = tmp_path / "slow-c++"  # compiles (-c) only after a long sleep: the kill lands mid-compile
    slow_cxx.write_text('#!/bin/sh\ncase " $* " in *" -c "*) echo "$$" > "$0.compiling"; sleep 600;; esac\n'
                        'exec c++ "$@"\n')
    slow_cxx.chmod(0o755)
    compiling = Path(f"{slow_cxx}.compiling")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    first = subprocess.Popen([sys.executable, "-c", BUILD, str(src), str(build_dir)], cwd=ROOT,
                             env={**env, "CXX": str(slow_cxx)}, start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not compiling.exists():  # ninja has started the compiler, under our lock and torch's baton
        assert first.poll() is None, "the first build ended before its compiler started"
        assert time.monotonic() < deadline, "the first build never started compiling"
        time.sleep(0.05)
    assert (build_dir / "lock").exists() and (build_dir / "build.owner").read_text() == str(first.pid)
    os.killpg(first.pid, signal.SIGKILL)  # the builder, ninja and the compiler, mid-build
    first.wait(30)
    assert (build_dir / "lock").exists(), "the killed build left no baton: this test shows nothing"
    assert not list(build_dir.glob("*.so"))

    # a second build that waited forever on the baton would fail here, at the timeout
    second = subprocess.run([sys.executable, "-c", BUILD, str(src), str(build_dir)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=180)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "ANSWER 42" in second.stdout, second.stdout + second.stderr[-2000:]
    assert (build_dir / "built").exists() and not (build_dir / "lock").exists()
