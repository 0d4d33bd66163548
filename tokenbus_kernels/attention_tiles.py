"""What the paged decode and prefill attention kernels share: the @triton.jit pieces of their K/V loop
(Triton inlines them into each kernel, so the compiled code is what it was with the pieces written out in both;
tests/kernels compile both for sm_90 and check they do not spill) and the host-side checks of their arguments.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenbus_kernels.launch import check_head_dim

LOG2E = 1.4426950408889634


@triton.jit
def tanh_exp(x):
    """tanh from exp (portable to the interpreter and every GPU target): 1 - 2 / (e^2x + 1); saturates to
    +-1 without NaN (e^2x overflowing to inf gives 1, underflowing to 0 gives -1)."""
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def dequantize_tile(k, v, k_scale_ptr, v_scale_ptr, row_off, tok_ok, HEAD_DIM: tl.constexpr, dtype: tl.constexpr):
    """fp8 K and V tiles [BLOCK_N, HEAD_DIM] -> codes * their rows' scales, in `dtype`. row_off [BLOCK_N]: each
    row's first code (bytes); its scale is the fp32 after the HEAD_DIM codes, read through a float32 view of
    the same cache (k_scale_ptr), hence the // 4. Masked rows get scale 0: zeros, never junk."""
    scale_at = (row_off + HEAD_DIM) // 4
    k_s = tl.load(k_scale_ptr + scale_at, mask=tok_ok, other=0.0)
    v_s = tl.load(v_scale_ptr + scale_at, mask=tok_ok, other=0.0)
    return (k.to(tl.float32) * k_s[:, None]).to(dtype), (v.to(tl.float32) * v_s[:, None]).to(dtype)


@triton.jit
def scaled_q(ptrs, mask, qk_scale):
    """The q tile at ptrs times qk_scale, in q's dtype: the softmax scale and log2(e) folded into q once, so the
    K/V loop uses exp2 on raw dot products."""
    q = tl.load(ptrs, mask=mask, other=0.0)
    return (q.to(tl.float32) * qk_scale).to(q.dtype)


@triton.jit
def kv_tile(k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, table_row, head_off, kv_head, tile, end, dim_ok,
             stride_cb, stride_co, stride_ch, dtype: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_SIZE: tl.constexpr, KV_FP8: tl.constexpr):
    """The K/V tile of BLOCK_N tokens from `tile` (those >= end masked), gathered through the sequence's block
    table row: (tokens, tok_ok, k, v), k and v [BLOCK_N, HEAD_PAD] in `dtype` (fp8 dequantized)."""
    tokens = tile + tl.arange(0, BLOCK_N)
    tok_ok = tokens < end
    blocks = tl.load(table_row + tokens // BLOCK_SIZE, mask=tok_ok, other=0).to(tl.int64)
    kv_off = blocks[:, None] * stride_cb + (tokens % BLOCK_SIZE)[:, None] * stride_co + head_off
    k = tl.load(k_cache_ptr + kv_off, mask=tok_ok[:, None] & dim_ok[None, :], other=0.0)
    v = tl.load(v_cache_ptr + kv_off, mask=tok_ok[:, None] & dim_ok[None, :], other=0.0)
    if KV_FP8:
        k, v = dequantize_tile(k, v, k_scale_ptr, v_scale_ptr, blocks * stride_cb
                                + (tokens % BLOCK_SIZE) * stride_co + kv_head * stride_ch, tok_ok,
                                HEAD_DIM, dtype)
    return tokens, tok_ok, k, v


@triton.jit
def qk_scores(q, k, softcap, DOT_FP32: tl.constexpr, FP32_DOT: tl.constexpr, SOFTCAP: tl.constexpr):
    """q · kᵀ (q pre-scaled, log2 units), soft-capped if SOFTCAP (softcap in log2 units too)."""
    if DOT_FP32:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision=FP32_DOT)
    else:
        s = tl.dot(q, tl.trans(k))
    if SOFTCAP:
        s = softcap * tanh_exp(s / softcap)
    return s


@triton.jit
def softmax_start(ROWS: tl.constexpr, HEAD_PAD: tl.constexpr):
    """The online softmax's state before the first tile: (running max -inf, running sum 0, accumulator 0)."""
    return (tl.full([ROWS], float("-inf"), tl.float32), tl.zeros([ROWS], tl.float32),
            tl.zeros([ROWS, HEAD_PAD], tl.float32))


@triton.jit
def softmax_accumulate(acc, l_i, p, alpha, v, DOT_FP32: tl.constexpr, FP32_DOT: tl.constexpr):
    """The online softmax's step after p and alpha: (acc * alpha + p · v, l_i * alpha + Σ p)."""
    l_i = l_i * alpha + tl.sum(p, 1)
    if DOT_FP32:
        # Round p as the GPU path does before the PV product, then multiply in fp32.
        pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision=FP32_DOT)
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return acc * alpha[:, None] + pv, l_i


@triton.jit
def dims_in_head(dims, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr):
    """Which of the HEAD_PAD (a power of two, as tl.arange needs) lanes hold a real dim: all of them unless
    head_dim is not a power of two (Phi-3's 96). A constant mask when none is padded, so power-of-two heads
    compile to the unmasked loads they always had."""
    if HEAD_PAD == HEAD_DIM:
        return tl.full([HEAD_PAD], 1, tl.int1)
    return dims < HEAD_DIM


def cache_scales(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 who: str) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Checks the caches against q; returns (k_scale, v_scale, fp8): float32 views of fp8 caches (each row's
    scale is element head_dim / 4 of its row there), or the caches themselves (unread) otherwise."""
    head_dim = q.shape[2]
    if v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride() or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"{who}: k_cache and v_cache must share dtype, shape and strides")
    if k_cache.dtype == torch.float8_e4m3fn:
        if k_cache.shape[3] != head_dim + 4 or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError(f"{who}: an fp8 cache must be contiguous [..., head_dim + 4] "
                             "(tokenbus_kernels/kv_quant.py), "
                             f"got {tuple(k_cache.shape)} for head_dim {head_dim}")
        return k_cache.view(torch.float32), v_cache.view(torch.float32), True
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"{who}: q {tuple(q.shape)} does not fit cache {tuple(k_cache.shape)}")
    if q.dtype != k_cache.dtype:
        raise ValueError(f"{who}: q {q.dtype} and caches {k_cache.dtype}/{v_cache.dtype} must share a dtype "
                         "(or the caches be fp8)")
    return k_cache, v_cache, False


def check_attention(who: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The checks decode and prefill share: q's heads against the cache's, head_dim, the caches (cache_scales,
    whose result this returns) and out (q's shape, a contiguous last dim)."""
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"{who}: q {tuple(q.shape)} does not fit cache {tuple(k_cache.shape)}")
    check_head_dim(who, q.shape[2])
    scales = cache_scales(q, k_cache, v_cache, who)
    if out.shape != q.shape or out.stride(2) != 1:
        raise ValueError(f"{who}: out must have q's shape and a contiguous last dim")
    return scales
