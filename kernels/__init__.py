"""Paged-attention kernels. CUDA tensors run the Triton kernels. CPU tensors run the C++ kernels of
kernels/cpu.py (float32, contiguous caches) or else the PyTorch references; under TRITON_INTERPRET=1 CPU
tensors run the Triton kernels in Triton's interpreter instead."""

from __future__ import annotations

import os

import torch

from kernels import cpu
from kernels.reference import paged_decode_attention_ref, paged_prefill_attention_ref, write_kv_ref

__all__ = ["write_kv", "paged_decode_attention", "paged_prefill_attention", "use_triton", "backend"]


# read once, as Triton itself reads it once (when the kernel modules define their @triton.jit functions);
# use_triton runs for every kernel call of every layer
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or INTERPRET


def _cpu_kernels(t: torch.Tensor, k_cache: torch.Tensor):
    if t.dtype != k_cache.dtype or t.stride(-1) != 1 or not k_cache.is_contiguous():
        return None
    return cpu.usable(t)


def backend(device: torch.device | str, dtype: torch.dtype) -> str:
    """Which implementation serves a model on this device and dtype (builds the CPU kernels if needed)."""
    probe = torch.empty(0, device=device, dtype=dtype)
    if use_triton(probe):
        return "triton-interpreter" if probe.device.type == "cpu" else "triton"
    return "cpu-cpp" if cpu.usable(probe) is not None else "torch-reference"


def write_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    if use_triton(k):
        from kernels.kv_write import write_kv_triton

        return write_kv_triton(k, v, k_cache, v_cache, slot_mapping)
    if v.stride(-1) == 1 and (ext := _cpu_kernels(k, k_cache)) is not None:
        return ext.write_kv_cpu(k, v, k_cache, v_cache, slot_mapping)
    return write_kv_ref(k, v, k_cache, v_cache, slot_mapping)


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale: float) -> torch.Tensor:
    if use_triton(q):
        from kernels.decode_attention import paged_decode_attention_triton

        return paged_decode_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, scale)
    if (ext := _cpu_kernels(q, k_cache)) is not None:
        return ext.paged_decode_attention_cpu(q, k_cache, v_cache, block_tables, seq_lens, scale)
    return paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale)


def paged_prefill_attention(
    q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale: float
) -> torch.Tensor:
    if use_triton(q):
        from kernels.prefill_attention import paged_prefill_attention_triton

        return paged_prefill_attention_triton(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale)
    if (ext := _cpu_kernels(q, k_cache)) is not None:
        return _prefill_as_decode(ext, q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale)
    return paged_prefill_attention_ref(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale)


def _prefill_as_decode(ext, q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale: float) -> torch.Tensor:
    """Causal prefill on the CPU: each query token is a one-token decode over its own prefix (the tokens up to
    its position), so the decode kernel serves it; a sequence's context stays in cache across its tokens."""
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    seq_of_token = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens)
    index_in_seq = torch.arange(q.shape[0]) - cu_seqlens_q[:-1].long()[seq_of_token]
    token_lens = (seq_lens.long() - q_lens)[seq_of_token] + index_in_seq + 1
    token_tables = block_tables.index_select(0, seq_of_token)
    return ext.paged_decode_attention_cpu(q, k_cache, v_cache, token_tables, token_lens.int(), scale)
