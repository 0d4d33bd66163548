"""What every kernel suite shares: where its kernels run, how its random cases are named and seeded, and the
paged caches and packed queries they are built from.

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
UNUSED_BLOCK = 2**30  # table entries past a sequence's blocks: any read of one would fault
LENGTH_CASES = lambda bs: [1, bs - 1, bs, bs + 1, 4 * bs + 7]  # noqa: E731


def case_id(value) -> str:
    return str(value).removeprefix("torch.")


def generator(*case) -> torch.Generator:
    """A generator seeded by the case: crc32 of its repr, not hash() (str hashes change between processes)."""
    return torch.Generator().manual_seed(zlib.crc32(repr(case).encode()))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def paged_cache(lens, block_size, num_kv_heads, head_dim, dtype, gen, device=None):
    """Random caches (junk in every slot a kernel must not read) and shuffled, padded block tables."""
    need = [cdiv(n, block_size) for n in lens]
    num_blocks = sum(need) + 3
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.full((len(lens), max(need) + 1), UNUSED_BLOCK, dtype=torch.int32)
    for i, n in enumerate(need):
        table[i, :n] = torch.tensor(ids[:n], dtype=torch.int32)
        ids = ids[n:]
    device = device or DEVICE
    return k_cache.to(device), v_cache.to(device), table.to(device)


def strided(t: torch.Tensor, gen) -> torch.Tensor:
    """The same values as a non-contiguous view (heads interleaved with junk), as a fused qkv split gives."""
    n, h, d = t.shape
    wide = torch.randn(n, 2 * h + 1, d, generator=gen).to(t.dtype).to(t.device)
    wide[:, 1 : 2 * h + 1 : 2] = t
    return wide[:, 1 : 2 * h + 1 : 2]


def prefill_inputs(pairs, num_q_heads, head_dim, dtype, gen, device=None):
    """For prefill cases [(cached tokens, new query tokens)]: (q, cu_seqlens_q, seq_lens), q the new tokens of
    every sequence packed back to back (random, strided)."""
    device = device or DEVICE
    cu = [0]
    for _, q_len in pairs:
        cu.append(cu[-1] + q_len)
    q = strided(torch.randn(cu[-1], num_q_heads, head_dim, generator=gen).to(dtype).to(device), gen)
    cu_seqlens_q = torch.tensor(cu, dtype=torch.int32, device=device)
    return q, cu_seqlens_q, torch.tensor([c for c, _ in pairs], dtype=torch.int32, device=device)


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


def int8_linear(seed: int, w8a8: bool = False) -> torch.nn.Linear:
    """A 200 -> 77 nn.Linear quantized as the loader leaves it (worker/engine/quant/schemes.py): the int8
    weight with its scales in `int8`, the dequantized value as `weight`, a random bias; w8a8 marks it for
    per-token activation rounding too."""
    from worker.engine.quant.schemes import quantize_int8

    gen = torch.Generator().manual_seed(seed)
    linear = torch.nn.Linear(200, 77, bias=True)
    q = quantize_int8(torch.randn(77, 200, generator=gen) * 0.05)
    with torch.no_grad():
        linear.weight.copy_(q.dequantize())
        linear.bias.copy_(torch.randn(77, generator=gen))
    linear.int8 = q
    if w8a8:
        linear.w8a8 = True
    return linear


def stored_cache(cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A float32 cache [..., head_dim] as a `dtype` cache holds it (packed int8 rows, or rounded bf16)."""
    from tokenbus_kernels.kv_quant import quantize

    return quantize(cache, dtype) if dtype == torch.int8 else cache.to(dtype)
