"""Paged-attention kernels. CUDA tensors run the Triton kernels; CPU tensors run the PyTorch references,
unless TRITON_INTERPRET=1, where CPU tensors run the Triton kernels under Triton's interpreter."""

from __future__ import annotations

import os

import torch

from kernels.reference import paged_decode_attention_ref, paged_prefill_attention_ref, write_kv_ref

__all__ = ["write_kv", "paged_decode_attention", "paged_prefill_attention", "use_triton"]


def use_triton(t: torch.Tensor) -> bool:
    if t.is_cuda:
        return True
    return os.environ.get("TRITON_INTERPRET") == "1"


def write_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    if use_triton(k):
        from kernels.kv_write import write_kv_triton

        return write_kv_triton(k, v, k_cache, v_cache, slot_mapping)
    return write_kv_ref(k, v, k_cache, v_cache, slot_mapping)


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale: float) -> torch.Tensor:
    if use_triton(q):
        from kernels.decode_attention import paged_decode_attention_triton

        return paged_decode_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, scale)
    return paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale)


def paged_prefill_attention(
    q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale: float
) -> torch.Tensor:
    if use_triton(q):
        from kernels.prefill_attention import paged_prefill_attention_triton

        return paged_prefill_attention_triton(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale)
    return paged_prefill_attention_ref(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale)
