"""Triton kernels: rotary position embedding (neox / Hugging Face Llama style) on q and k in one launch,
optionally fused with the KV-cache write.

  q         [num_tokens, num_heads, head_dim]      (any strides: e.g. slices of the fused qkv output)
  k, v      [num_tokens, num_kv_heads, head_dim]   (any strides), k in q's dtype
  cos, sin  [num_tokens, head_dim] or [num_tokens, 1, head_dim] (RotaryEmbedding.cos_sin), q's dtype, any strides
  x <- x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x[half:], x[:half]); head_dim even (any: 80 works)

rotary_triton(q, k, cos, sin): q and k rotated IN PLACE; returns (q, k).
rotary_write_kv_triton(q, k, v, cos, sin, k_cache, v_cache, slot_mapping): q rotated IN PLACE (returned);
  the rotated k and v go straight into the paged caches [num_blocks, block_size, num_kv_heads, head_dim]
  at slot_mapping (int64 [num_tokens], -1 = skip), converted to the cache dtype. k itself is only read: the
  model reads K back from the cache (the attention kernels), so the rotated k is never written to k.
  This saves write_kv's launch and its re-read of k and v.

Each product and sum is rounded to q's dtype where eager PyTorch rounds (x*cos, rotate_half(x)*sin, their
sum), so fp16/bf16 results equal Hugging Face's to the bit (a product of two halves is exact in fp32).

Grid (num_tokens,): one program per token rotates all its q heads ([heads, head_dim / 2] tiles of the two
halves) and k heads with the token's cos/sin row, loaded once. Tile sizes and warps depend on the head
counts and head_dim only; nothing is read back to the host (CUDA-graph safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenbus_kernels.launch import Launch, check_launchable
from tokenbus_kernels.rounding import rounded


@triton.jit
def _rotate(x_ptr, t, stride_t, stride_h, stride_d, num_heads, c1, c2, s1, s2, half,
            BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, SOFT_BF16: tl.constexpr):
    """Token t's heads of x, rotated: fp32 tiles (first half, second half) [BLOCK_H, BLOCK_HALF] and their mask."""
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_HALF)
    mask = (heads < num_heads)[:, None] & (dims < half)[None, :]
    first = x_ptr + t * stride_t + heads[:, None] * stride_h + dims[None, :] * stride_d
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + half * stride_d, mask=mask, other=0.0).to(tl.float32)
    dtype = x_ptr.dtype.element_ty
    # rotate_half(x) = (-x2, x1); -(x2 * s) rounds as x2 * s does, so the sign moves onto the sum
    o1 = rounded(rounded(x1 * c1[None, :], dtype, SOFT_BF16) - rounded(x2 * s1[None, :], dtype, SOFT_BF16),
                 dtype, SOFT_BF16)
    o2 = rounded(rounded(x2 * c2[None, :], dtype, SOFT_BF16) + rounded(x1 * s2[None, :], dtype, SOFT_BF16),
                 dtype, SOFT_BF16)
    return o1, o2, mask


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_qt, stride_qh, stride_qd,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_ct, stride_cd, stride_st, stride_sd,
    stride_cb, stride_co, stride_ch, stride_cdim,
    stride_slot, num_q_heads, num_kv_heads, half, block_size,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
    WRITE_CACHE: tl.constexpr, SOFT_BF16: tl.constexpr,
):
    """Grid (num_tokens,): rotate token t's q (in place) and k (in place, or into k_cache with v if WRITE_CACHE)."""
    t = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)
    dim_ok = dims < half
    c1 = tl.load(cos_ptr + t * stride_ct + dims * stride_cd, mask=dim_ok, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t * stride_ct + (dims + half) * stride_cd, mask=dim_ok, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t * stride_st + dims * stride_sd, mask=dim_ok, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t * stride_st + (dims + half) * stride_sd, mask=dim_ok, other=0.0).to(tl.float32)

    q1, q2, q_mask = _rotate(q_ptr, t, stride_qt, stride_qh, stride_qd, num_q_heads, c1, c2, s1, s2, half,
                             BLOCK_HQ, BLOCK_HALF, SOFT_BF16)
    q_dst = q_ptr + t * stride_qt + tl.arange(0, BLOCK_HQ)[:, None] * stride_qh + dims[None, :] * stride_qd
    tl.store(q_dst, q1.to(q_ptr.dtype.element_ty), mask=q_mask)
    tl.store(q_dst + half * stride_qd, q2.to(q_ptr.dtype.element_ty), mask=q_mask)

    k1, k2, k_mask = _rotate(k_ptr, t, stride_kt, stride_kh, stride_kd, num_kv_heads, c1, c2, s1, s2, half,
                             BLOCK_HK, BLOCK_HALF, SOFT_BF16)
    kv_heads = tl.arange(0, BLOCK_HK)[:, None]
    if WRITE_CACHE:
        slot = tl.load(slot_ptr + t * stride_slot).to(tl.int64)
        # padding tokens (slot -1) cache no heads; q is rotated all the same. (A heads limit rather than
        # `mask & (slot >= 0)`: Triton 3.9's interpreter rejects a mask and-ed with a broadcast scalar.)
        k_mask = (kv_heads < tl.where(slot >= 0, num_kv_heads, 0)) & dim_ok[None, :]
        slot = tl.maximum(slot, 0)
        dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_co + kv_heads * stride_ch \
            + dims[None, :] * stride_cdim
        tl.store(k_cache_ptr + dst, k1.to(k_cache_ptr.dtype.element_ty), mask=k_mask)
        tl.store(k_cache_ptr + dst + half * stride_cdim, k2.to(k_cache_ptr.dtype.element_ty), mask=k_mask)
        v_src = v_ptr + t * stride_vt + kv_heads * stride_vh + dims[None, :] * stride_vd
        v1 = tl.load(v_src, mask=k_mask)
        v2 = tl.load(v_src + half * stride_vd, mask=k_mask)
        tl.store(v_cache_ptr + dst, v1.to(v_cache_ptr.dtype.element_ty), mask=k_mask)
        tl.store(v_cache_ptr + dst + half * stride_cdim, v2.to(v_cache_ptr.dtype.element_ty), mask=k_mask)
    else:
        k_dst = k_ptr + t * stride_kt + kv_heads * stride_kh + dims[None, :] * stride_kd
        tl.store(k_dst, k1.to(k_ptr.dtype.element_ty), mask=k_mask)
        tl.store(k_dst + half * stride_kd, k2.to(k_ptr.dtype.element_ty), mask=k_mask)


def _table_strides(table: torch.Tensor, num_tokens: int, head_dim: int, name: str) -> tuple[int, int]:
    if table.shape not in ((num_tokens, head_dim), (num_tokens, 1, head_dim)):
        raise ValueError(f"rotary: {name} {tuple(table.shape)} must be [{num_tokens}, {head_dim}] or "
                         f"[{num_tokens}, 1, {head_dim}]")
    return table.stride(0), table.stride(-1)


def plan_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, on_gpu: bool,
    v: torch.Tensor | None = None, k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
) -> list[Launch]:
    """Rotary in place on q and k; with v, caches and slot_mapping, k and v go to the caches instead."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if k.dim() != 3 or k.shape[0] != num_tokens or k.shape[2] != head_dim or head_dim % 2:
        raise ValueError(f"rotary: q {tuple(q.shape)} and k {tuple(k.shape)} must be [n, heads, head_dim], "
                         f"head_dim even")
    if not (q.dtype == k.dtype == cos.dtype == sin.dtype):
        raise ValueError(f"rotary: q {q.dtype}, k {k.dtype}, cos {cos.dtype}, sin {sin.dtype} must share a dtype")
    cos_strides = _table_strides(cos, num_tokens, head_dim, "cos")
    sin_strides = _table_strides(sin, num_tokens, head_dim, "sin")
    write_cache = k_cache is not None
    if write_cache:
        if v is None or v_cache is None or slot_mapping is None:
            raise ValueError("rotary_write_kv: needs v, k_cache, v_cache and slot_mapping")
        if v.shape != k.shape or k_cache.shape[2:] != (num_kv_heads, head_dim):
            raise ValueError(f"rotary_write_kv: k {tuple(k.shape)}, v {tuple(v.shape)}, cache {tuple(k_cache.shape)}")
        if v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
            raise ValueError("rotary_write_kv: k_cache and v_cache must share shape and strides")
        if slot_mapping.shape != (num_tokens,):
            raise ValueError(f"rotary_write_kv: slot_mapping {tuple(slot_mapping.shape)} for {num_tokens} tokens")
        block_size = k_cache.shape[1]
    else:
        v, k_cache, v_cache, slot_mapping = k, q, q, q  # not touched without WRITE_CACHE
        block_size = 1
    if num_tokens == 0:
        return []
    cache_strides = k_cache.stride() if write_cache else (0, 0, 0, 0)
    args = (
        q, k, v, cos, sin, k_cache, v_cache, slot_mapping,
        *q.stride(), *k.stride(), *v.stride(), *cos_strides, *sin_strides, *cache_strides,
        slot_mapping.stride(0) if write_cache else 0, num_q_heads, num_kv_heads, head_dim // 2, block_size,
    )
    block_hq, block_half = triton.next_power_of_2(num_q_heads), triton.next_power_of_2(head_dim // 2)
    meta = {
        "BLOCK_HQ": block_hq, "BLOCK_HK": triton.next_power_of_2(num_kv_heads), "BLOCK_HALF": block_half,
        "WRITE_CACHE": write_cache, "SOFT_BF16": not on_gpu, "enable_fp_fusion": False,
        # ~8 elements of each q half a thread (32 heads x 128 dims: 8 warps)
        "num_warps": max(1, min(8, block_hq * block_half // 256)),
    }
    return [Launch(_rotary_kernel, (num_tokens,), args, meta)]


def rotary_triton(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k in place; returns (q, k). See the module doc for shapes."""
    check_launchable(_rotary_kernel, q)
    for launch in plan_rotary(q, k, cos, sin, q.is_cuda):
        launch()
    return q, k


def rotary_write_kv_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Rotate q in place (returned) and write rotated k and v into the caches at slot_mapping; k is only read."""
    check_launchable(_rotary_kernel, q)
    for launch in plan_rotary(q, k, cos, sin, q.is_cuda, v, k_cache, v_cache, slot_mapping):
        launch()
    return q
