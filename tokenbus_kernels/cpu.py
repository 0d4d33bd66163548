"""The CPU serving path's C++ kernels, float32: csrc/cpu_kernels.cpp (RMSNorm, SiLU·mul, RoPE, a row-wise
argmax and a panel GEMV), csrc/cpu_attention.cpp (write_kv over a float32, bfloat16 or int8 KV cache),
csrc/cpu_attention_block.cpp and cpu_decode_attention.cpp (paged decode attention over such a cache: one
block's math, then the walk over blocks and sequences), csrc/cpu_cascade_attention.cpp (the same for rows
that share a prefix: its blocks read once for all of them, tokenbus_kernels/cascade.py), csrc/cpu_prefill_attention.cpp
(paged causal prefill attention over such a cache: tiles of query tokens per block), csrc/cpu_w8a8.cpp (the
panel GEMV with int8 weights and int8 activations per token and group of 64, VNNI), csrc/cpu_quant.cpp (the
panel GEMV with int8 weights), csrc/cpu_lora.cpp (the LoRA deltas of a decode step's adapter rows) and
csrc/decode_layers.cpp (a pure decode step's decoder layers composed of those kernels in one call).
worker/engine/backends/cpu.py is their user.

Built once per machine with torch's cpp_extension (g++ and ninja; ~32 s of CPU on a Xeon: one translation unit of ten
files) into the tokenbus cache directory and loaded from there afterwards. The build is keyed by the source,
the compiler flags, the torch version,
the CPU's instruction sets (the code is compiled for the CPU it runs on) and the real paths (symlinks
resolved) of torch, the compiler and Python: a worktree whose .venv is a link to another checkout's venv
reaches the same toolchain, so it loads the same build. A finished build is loaded as it is, not handed to
torch's load again: that re-emits ninja's build file with torch's include paths as this process
spells them, and ninja rebuilds when a command line changes. Where it cannot be built (no compiler, a
read-only cache) extension() returns None after one warning, and the engine serves with the PyTorch
references.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.util
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import structlog
import torch

# one translation unit, in this order: cpu_kernels.cpp's helpers come first (check_layout, the panel tiles),
# each later file calls the functions of those before it, decode_layers.cpp those of all the others
SOURCES = [Path(__file__).with_name("csrc") / name
           for name in ("cpu_kernels.cpp", "cpu_attention.cpp", "cpu_attention_block.cpp",
                        "cpu_decode_attention.cpp", "cpu_cascade_attention.cpp", "cpu_prefill_attention.cpp",
                        "cpu_w8a8.cpp", "cpu_quant.cpp", "cpu_lora.cpp", "decode_layers.cpp")]
FUNCTIONS = [
    "write_kv_cpu", "paged_decode_attention_cpu",  # the CPU versions of three tokenbus_kernels/reference.py functions
    "paged_prefill_attention_cpu",
    "cascade_decode_attention_cpu",  # decode rows sharing a prefix read it once (tokenbus_kernels/cascade.py)
    "add_rms_norm_cpu", "rms_norm_cpu", "silu_and_mul_cpu", "rotary_cpu",  # a decoder layer's elementwise ops
    "argmax_rows_cpu",  # greedy sampling
    "panel_linear_cpu",  # decode-sized linear layers (worker/engine/backends/cpu_linear.py)
    "panel_linear_int8_cpu",  # the same with int8 weights (worker/engine/quant/schemes.py)
    "panel_linear_w8a8_cpu", "w8a8_native_cpu",  # int8 weights and activations (VNNI) and whether it runs here
    "decode_layers_cpu",  # a decode step's layers in one call (worker/engine/backends/cpu_decode.py)
    "lora_cpu",  # LoRA deltas of a decode-sized batch's adapter rows (worker/engine/backends/cpu.py)
]
# -ffast-math lets g++ vectorise exp and the dot-product reductions (the kernels never rely on inf/NaN);
# -fopenmp because at::parallel_for's OpenMP pragmas sit in ATen's headers: without it, one thread;
# -mprefer-vector-width=512 because for Intel CPUs -march=native also means 256: the auto-vectorised fp32 panel
# loop then ran on ymm, 3.1x slower on a Xeon (639 against 205 us, 576->1536 at 16 rows, one thread)
CFLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-fopenmp"]
BUILT = "built"  # written in a build directory once its module has been built and loaded

log = structlog.get_logger("tokenbus.kernels")


def cpu_flags() -> str:
    """The "flags" line of /proc/cpuinfo (the instruction sets the build compiles for), or "" where unreadable."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def cache_root(cache_dir: str | None = None) -> Path:
    """tokenbus's cache directory (dequantised GGUF weights, built CPU kernels): cache_dir if given, else
    TOKENBUS_CACHE_DIR, else ~/.cache/tokenbus."""
    return Path(cache_dir or os.environ.get("TOKENBUS_CACHE_DIR") or Path.home() / ".cache" / "tokenbus")


@functools.cache
def extension(cache_dir: str | None = None, avx2_only: bool = False) -> ModuleType | None:
    """The compiled module, or None (with one logged warning) where it cannot be built. avx2_only builds the
    AVX2 paths on an AVX-512 machine (tests: both paths of each kernel with intrinsics run here)."""
    sources = [path.read_text() for path in SOURCES]
    cflags = CFLAGS + (["-mno-avx512f"] if avx2_only else [])
    key = "\n".join([*sources, " ".join(cflags), torch.__version__, cpu_flags(), *toolchain()])
    name = "tokenbus_cpu_" + hashlib.sha256(key.encode()).hexdigest()[:16]
    started = time.perf_counter()
    try:
        from torch.utils.cpp_extension import load

        build_dir = cache_root(cache_dir) / "cpu_kernels" / name

        def build() -> ModuleType:
            # load, not load_inline: load_inline puts <torch/extension.h> ahead of the sources (cpu_kernels.cpp
            # includes less, and says why)
            main = build_dir / "main.cpp"
            main.write_text("\n".join([*sources, bindings(FUNCTIONS)]))
            return load(name, sources=[str(main)], extra_cflags=cflags, extra_ldflags=["-fopenmp"],
                        build_directory=str(build_dir))

        module = build_once(name, build_dir, build)
    except Exception as err:  # noqa: BLE001 - any build failure means: serve with the references
        log.warning(
            "cpu_kernels_unavailable", error=f"{type(err).__name__}: {str(err)[-400:]}",
            fallback="the PyTorch reference kernels (slower decode attention)",
            fix="install g++ and ninja, or set TOKENBUS_CACHE_DIR to a writable directory",
        )
        return None
    log.debug("cpu_kernels_ready", module=name, seconds=round(time.perf_counter() - started, 1))
    return module


def bindings(functions: list[str]) -> str:
    """The pybind11 module that exposes `functions` (as load_inline's `functions` argument writes it)."""
    lines = [f'm.def("{f}", torch::wrap_pybind_function({f}), "{f}");' for f in functions]
    return "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {\n" + "\n".join(lines) + "\n}\n"


def toolchain() -> list[str]:
    """What the module is built with besides its sources and flags, as real paths: torch (its headers and
    libraries), the C++ compiler torch calls, and Python (the module's ABI)."""
    from torch.utils.cpp_extension import get_cxx_compiler

    compiler = get_cxx_compiler()
    return [os.path.realpath(os.path.dirname(torch.__file__)), os.path.realpath(shutil.which(compiler) or compiler),
            os.path.realpath(sys.executable), sys.version]


def build_once(name: str, build_dir: Path, build: Callable[[], ModuleType]) -> ModuleType:
    """The module `name` in build_dir: the finished build's, else what build() (a torch cpp_extension load into
    build_dir) returns, built under build_lock. extension()'s builder; tests/kernels/test_cpu_build_lock.py
    kills a build of a small module half-way through it."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with build_lock(build_dir):
        module = load_built(name, build_dir)
        if module is None:
            # torch's own baton: a file that a killed build leaves behind, after which torch waits forever.
            # Holding our lock means no other build is running, so any baton here is such a leftover.
            (build_dir / "lock").unlink(missing_ok=True)
            module = build()
            (build_dir / BUILT).touch()
    return module


def load_built(name: str, build_dir: Path) -> ModuleType | None:
    """The module a finished build left in build_dir (the file torch's load imports), or None."""
    library = build_dir / f"{name}.so"
    if not (build_dir / BUILT).exists() or not library.exists():
        return None
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextmanager
def build_lock(build_dir: Path) -> Iterator[None]:
    """One build per directory at a time, across processes. An flock belongs to its process: the kernel drops
    it when that process dies (SIGKILL included), so the next one takes over instead of waiting forever. The
    file records the owner's pid, for the log line of whoever waits."""
    path = build_dir / "build.owner"
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            log.info("cpu_kernels_waiting", owner_pid=f.read().strip() or "unknown", lock=str(path),
                     why="another process is building the same kernels; this one loads them when it ends")
            fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
