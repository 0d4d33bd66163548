"""Kernel-test helpers: compiling Triton launch plans for sm_90 without a GPU, reading a cubin's stack use
(the checks that GPU plans compile without register spills), and running a test file under the interpreter."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest


def compile_for_sm90(launch):
    """Compile a planned launch as Triton's JIT would for an H100/H200, without a GPU: same specialisation of
    arguments (ints equal to 1 become constants, 16-divisible ints and pointers get divisibility hints). The
    plan's num_warps, num_stages and enable_fp_fusion become compiler options (the fused kernels turn fusion
    off: with it ptxas would contract HF's separately rounded products into fmas, see tokenbus_kernels/rounding.py)."""
    import triton
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import native_specialize_impl

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    meta = dict(launch.meta)
    options = {key: meta.pop(key) for key in ("num_warps", "num_stages", "enable_fp_fusion") if key in meta}
    signature, constants, attrs = {}, {}, {}
    args = iter(launch.args)
    for i, name in enumerate(launch.kernel.arg_names):
        if name in meta:
            signature[name], constants[(i,)] = "constexpr", meta[name]
            continue
        kind, attr = native_specialize_impl(BaseBackend, next(args), False, True, True)
        signature[name] = kind
        if kind == "constexpr":
            constants[(i,)] = attr
        elif isinstance(attr, str) and attr:
            attrs[(i,)] = backend.parse_attr(attr)
    return triton.compile(ASTSource(launch.kernel, signature, constants, attrs), target=target, options=options)


def check_attention_compiles(launches, tmp_path: Path) -> None:
    """Every launch compiles for sm_90 without register spills, and the attention kernels' K/V loops are
    software-pipelined (async copies), which the bandwidth target depends on."""
    for launch in launches:
        compiled = compile_for_sm90(launch)
        name = launch.kernel.__name__
        assert stack_bytes(compiled.asm["cubin"], tmp_path) == 0, f"{name} spills registers"
        if name in ("_decode_partition_kernel", "_prefill_kernel"):
            assert "async_copy_global_to_local" in compiled.asm["ttgir"], f"{name}: K/V loop not pipelined"


def stack_bytes(cubin: bytes, tmp_path: Path) -> int:
    import triton.backends.nvidia

    cuobjdump = Path(triton.backends.nvidia.__file__).parent / "bin" / "cuobjdump"
    if not cuobjdump.exists():
        pytest.skip(f"{cuobjdump} is missing: this triton build has no bundled CUDA tools")
    path = tmp_path / "kernel.cubin"
    path.write_bytes(cubin)
    usage = subprocess.run([str(cuobjdump), "-res-usage", str(path)], capture_output=True, text=True, check=True)
    return int(re.search(r"STACK:(\d+)", usage.stdout).group(1))

