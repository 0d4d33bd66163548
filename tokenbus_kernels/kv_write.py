"""Triton kernel: scatter new K/V rows into the paged KV cache.

k, v          [num_tokens, num_kv_heads, head_dim] (any strides)
k/v_cache     [num_blocks, block_size, num_kv_heads, head_dim] (any strides, both caches alike), or fp8
              (float8_e4m3fn, contiguous [..., head_dim + 4]): each row quantized on write, scale = max|x| / 448,
              codes = fp8(x * (448 / max|x|)), the scale stored after the codes (tokenbus_kernels/kv_quant.quantize)
slot_mapping  int64 [num_tokens] = block_id * block_size + offset; -1 marks padding and is skipped
Grid: (num_tokens,). Each program moves one token's [num_kv_heads, head_dim] tile of K and of V.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenbus_kernels.launch import Launch, check_head_dim, check_launchable, head_pad

FP8_MAX = tl.constexpr(448.0)  # e4m3's largest finite value (constexpr: a jit function may read it)


@triton.jit
def _round_e4m3(x):
    """fp32 x (|x| <= 448) rounded to the nearest e4m3 value, ties to even, as torch's .to(float8_e4m3fn)
    rounds: normal values keep 3 of fp32's 23 mantissa bits; below 2**-6 (e4m3's subnormals) the step is
    2**-9 (rounded with the 1.5 * 2**23 trick). The fp8 store then converts an exact value. Why not let the
    store round: Triton 3.9's interpreter rounds wrong where the rounding carries into the exponent
    (-127.9 -> -64, not -128); the GPU's conversion gets the same, already exact, values."""
    bits = x.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)  # clear 20 bits
    subnormal = ((x * 512.0 + 12582912.0) - 12582912.0) / 512.0
    return tl.where(tl.abs(x) < 0.015625, subnormal, normal)


@triton.jit
def _quantize_rows(x):
    """fp32 rows [BLOCK_H, HEAD_DIM] -> (x * (448 / max|x|) clamped to +-448, max|x| / 448) per row; an
    all-zero row gets scale 0 and codes 0."""
    amax = tl.max(tl.abs(x), 1)
    inv = tl.where(amax > 0, FP8_MAX / tl.maximum(amax, 1e-30), 0.0)  # both sides run: no 1 / 0
    codes = _round_e4m3(tl.minimum(tl.maximum(x * inv[:, None], -FP8_MAX), FP8_MAX))
    return codes, amax / FP8_MAX


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_cb, stride_co, stride_ch, stride_cd,
    num_kv_heads, block_size,
    BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, KV_FP8: tl.constexpr,
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

    # padded lanes read 0: an fp8 row's max|x| spans them
    k = tl.load(k_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :] * stride_kd, mask=mask,
                other=0.0)
    v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :] * stride_vd, mask=mask,
                other=0.0)
    dst = block * stride_cb + offset * stride_co + heads[:, None] * stride_ch + dims[None, :] * stride_cd
    if KV_FP8:
        # the scales go through float32 views of the caches: element (row start + HEAD_DIM) // 4
        scale_at = (block * stride_cb + offset * stride_co + heads * stride_ch + HEAD_DIM) // 4
        k, k_scale = _quantize_rows(k.to(tl.float32))
        v, v_scale = _quantize_rows(v.to(tl.float32))
        tl.store(k_scale_ptr + scale_at, k_scale, mask=heads < num_kv_heads)
        tl.store(v_scale_ptr + scale_at, v_scale, mask=heads < num_kv_heads)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def plan_write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    on_gpu: bool,
) -> list[Launch]:
    num_tokens, num_kv_heads, head_dim = k.shape
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if v.shape != k.shape or k_cache.shape[2:] != (num_kv_heads, head_dim + (4 if fp8 else 0)):
        raise ValueError(f"write_kv: k {tuple(k.shape)}, v {tuple(v.shape)}, cache {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride() or v_cache.dtype != k_cache.dtype:
        raise ValueError("write_kv: k_cache and v_cache must share dtype, shape and strides")
    if fp8 and not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("write_kv: an fp8 cache must be contiguous (tokenbus_kernels/kv_quant.py)")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"write_kv: slot_mapping {tuple(slot_mapping.shape)} for {num_tokens} tokens")
    check_head_dim("write_kv", head_dim)
    if num_tokens == 0:
        return []
    scales = (k_cache.view(torch.float32), v_cache.view(torch.float32)) if fp8 else (k_cache, v_cache)
    args = (
        k, v, k_cache, v_cache, *scales, slot_mapping,
        *k.stride(), *v.stride(), *k_cache.stride(),
        num_kv_heads, k_cache.shape[1],
    )
    meta = {"BLOCK_H": triton.next_power_of_2(num_kv_heads), "HEAD_DIM": head_dim, "HEAD_PAD": head_pad(head_dim),
            "KV_FP8": fp8, "num_warps": 2}
    return [Launch(_write_kv_kernel, (num_tokens,), args, meta)]


def write_kv_triton(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write k, v [num_tokens, num_kv_heads, head_dim] into the caches at slot_mapping (in place)."""
    check_launchable(_write_kv_kernel, k)
    for launch in plan_write_kv(k, v, k_cache, v_cache, slot_mapping, on_gpu=k.is_cuda):
        launch()
