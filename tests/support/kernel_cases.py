"""What every Triton kernel suite shares: where its kernels run and how its random cases are named and seeded.

scripts/test runs each interpreted suite in a pytest process of its own with TRITON_INTERPRET=1 (kernels on CPU
tensors); the parent process runs the kernel tests on CUDA when there is a GPU, and the checks that need no
kernel (plans, sm_90 compiles, references) once, never under the interpreter.
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED else "cuda"
needs_kernels = pytest.mark.skipif(
    not INTERPRETED and not torch.cuda.is_available(),
    reason="no GPU: runs on the CPU in scripts/test's TRITON_INTERPRET=1 process",
)
parent_only = pytest.mark.skipif(INTERPRETED, reason="runs once, in the parent process")


def case_id(value) -> str:
    return str(value).removeprefix("torch.")


def generator(*case) -> torch.Generator:
    """A generator seeded by the case: crc32 of its repr, not hash() (str hashes change between processes)."""
    return torch.Generator().manual_seed(zlib.crc32(repr(case).encode()))


def attention_plan_inputs(dtype, hq: int, hk: int, head_dim: int, block_size: int = 16, num_seqs: int = 4):
    """Arguments the attention wrappers plan GPU launches from (their values never matter, nothing runs):
    (k_cache, block table, seq_lens, decode q, prefill q, prefill cu_seqlens)."""
    k_cache = torch.randn(64, block_size, hk, head_dim).to(dtype)
    table = torch.zeros(num_seqs, 16, dtype=torch.int32)
    seq_lens = torch.full((num_seqs,), 200, dtype=torch.int32)
    q = torch.randn(num_seqs, hq, head_dim).to(dtype)
    q_prefill = torch.randn(40, hq, head_dim).to(dtype)
    cu = torch.tensor([0, 10, 20, 30, 40], dtype=torch.int32)
    return k_cache, table, seq_lens, q, q_prefill, cu


def count_calls(obj, ext_function: str) -> list[int]:
    """Rows of x per call of obj.ext's ext_function from now on (CpuLinear: which kernel served a call)."""
    calls: list[int] = []
    real = getattr(obj.ext, ext_function)

    def spy(*args):
        calls.append(args[0].shape[0])
        return real(*args)

    obj.ext = type("Spy", (), {ext_function: staticmethod(spy)})()
    return calls
