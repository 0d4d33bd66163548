"""Triton kernel: scatter new K/V rows into the paged KV cache.

k, v          [num_tokens, num_kv_heads, head_dim] (any strides)
k/v_cache     [num_blocks, block_size, num_kv_heads, head_dim] (any strides, both caches alike)
slot_mapping  int64 [num_tokens] = block_id * block_size + offset; -1 marks padding and is skipped
Grid: (num_tokens,). Each program moves one token's [num_kv_heads, head_dim] tile of K and of V.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import Launch, check_head_dim, check_launchable, head_pad


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_cb, stride_co, stride_ch, stride_cd,
    num_kv_heads, block_size,
    BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
):
    """Grid (num_tokens,): token i's k, v [num_kv_heads, HEAD_DIM] -> caches[slot // block_size, slot % block_size]."""
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // block_size
    offset = slot % block_size
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HEAD_PAD)
    mask = (heads < num_kv_heads)[:, None] & (dims < HEAD_DIM)[None, :]

    k = tl.load(k_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :] * stride_kd, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :] * stride_vd, mask=mask)
    dst = block * stride_cb + offset * stride_co + heads[:, None] * stride_ch + dims[None, :] * stride_cd
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def plan_write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    on_gpu: bool,
) -> list[Launch]:
    num_tokens, num_kv_heads, head_dim = k.shape
    if v.shape != k.shape or k_cache.shape[2:] != (num_kv_heads, head_dim):
        raise ValueError(f"write_kv: k {tuple(k.shape)}, v {tuple(v.shape)}, cache {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
        raise ValueError("write_kv: k_cache and v_cache must share shape and strides")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"write_kv: slot_mapping {tuple(slot_mapping.shape)} for {num_tokens} tokens")
    check_head_dim("write_kv", head_dim)
    if num_tokens == 0:
        return []
    args = (
        k, v, k_cache, v_cache, slot_mapping,
        *k.stride(), *v.stride(), *k_cache.stride(),
        num_kv_heads, k_cache.shape[1],
    )
    meta = {"BLOCK_H": triton.next_power_of_2(num_kv_heads), "HEAD_DIM": head_dim, "HEAD_PAD": head_pad(head_dim),
            "num_warps": 2}
    return [Launch(_write_kv_kernel, (num_tokens,), args, meta)]


def write_kv_triton(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write k, v [num_tokens, num_kv_heads, head_dim] into the caches at slot_mapping (in place)."""
    check_launchable(_write_kv_kernel, k)
    for launch in plan_write_kv(k, v, k_cache, v_cache, slot_mapping, on_gpu=k.is_cuda):
        launch()
