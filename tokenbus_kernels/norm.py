"""Triton kernels: RMSNorm, with the decoder layer's residual add folded in.

add_rms_norm_triton(x, residual, weight, eps), IN PLACE:
    residual <- residual + x             (rounded to the dtype, as the eager add is)
    x        <- rms_norm(residual) * weight
  x, residual  [num_tokens, hidden], same dtype (fp32/fp16/bf16), any strides, not overlapping
  weight       [hidden], any float dtype; returns (x, residual), the same tensor objects
rms_norm_triton(x, weight, eps, out=None) -> out:
  x            [num_tokens, hidden] or [num_tokens, num_heads, hidden] (per-head norms, e.g. Qwen3's q/k norm
               on strided views of the fused qkv output), any strides
  out          x's shape and dtype, any strides; allocated contiguous if None; may be x itself (in place)

Arithmetic is Hugging Face's LlamaRMSNorm: the row is normalised in fp32 (sum of squares in fp32, mean,
rsqrt(mean + eps)), rounded to the dtype, then multiplied by the weight and rounded again.

Grid (num_tokens, num_heads): one program per row. A row of up to MAX_BLOCK elements is held in registers
in one pass (one read of x and residual, one write of each). Wider rows take two passes over
MAX_BLOCK-sized chunks: the first sums the squares, the second recomputes residual + x (re-read, from L2),
writes it and the normalised row; each chunk is read before it is written, so writing in place is safe.
The block size and warps depend on `hidden` only, and nothing is read back to the host (CUDA-graph safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenbus_kernels.launch import Launch, check_launchable
from tokenbus_kernels.rounding import rounded

MAX_BLOCK = 8192


@triton.jit
def _row(x_row, res_row, cols, mask, stride_xd, stride_rd, HAS_RESIDUAL: tl.constexpr, SOFT_BF16: tl.constexpr):
    """fp32 values of x (+ residual, rounded to x's dtype as the eager add rounds) at `cols` of one row."""
    r = tl.load(x_row + cols * stride_xd, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r += tl.load(res_row + cols * stride_rd, mask=mask, other=0.0).to(tl.float32)
        r = rounded(r, x_row.dtype.element_ty, SOFT_BF16)
    return r


@triton.jit
def _normed(r, inv, w_ptr, cols, mask, stride_w, dtype: tl.constexpr, out_dtype: tl.constexpr,
            SOFT_BF16: tl.constexpr):
    """weight * (r * inv rounded to the input dtype), rounded to out_dtype: LlamaRMSNorm's two roundings."""
    w = tl.load(w_ptr + cols * stride_w, mask=mask, other=0.0).to(tl.float32)
    return rounded(w * rounded(r * inv, dtype, SOFT_BF16), out_dtype, SOFT_BF16)


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr,
    stride_xn, stride_xh, stride_xd,
    stride_rn, stride_rd,
    stride_on, stride_oh, stride_od,
    stride_w, hidden, eps,
    BLOCK: tl.constexpr, SINGLE_PASS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, SOFT_BF16: tl.constexpr,
):
    """Grid (num_tokens, num_heads): row (token, head) of x (+ residual) -> out (and residual if HAS_RESIDUAL)."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    x_row = x_ptr + token * stride_xn + head * stride_xh
    res_row = res_ptr + token * stride_rn
    out_row = out_ptr + token * stride_on + head * stride_oh
    dtype = x_ptr.dtype.element_ty
    out_dtype = out_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    if SINGLE_PASS:
        mask = cols < hidden
        r = _row(x_row, res_row, cols, mask, stride_xd, stride_rd, HAS_RESIDUAL, SOFT_BF16)
        inv = tl.math.rsqrt(tl.sum(r * r, 0) / hidden + eps)
        if HAS_RESIDUAL:
            tl.store(res_row + cols * stride_rd, r.to(dtype), mask=mask)
        y = _normed(r, inv, w_ptr, cols, mask, stride_w, dtype, out_dtype, SOFT_BF16)
        tl.store(out_row + cols * stride_od, y.to(out_dtype), mask=mask)
    else:
        squares = tl.zeros([BLOCK], tl.float32)
        for start in range(0, hidden, BLOCK):
            mask = start + cols < hidden
            r = _row(x_row, res_row, start + cols, mask, stride_xd, stride_rd, HAS_RESIDUAL, SOFT_BF16)
            squares += r * r
        inv = tl.math.rsqrt(tl.sum(squares, 0) / hidden + eps)
        for start in range(0, hidden, BLOCK):
            mask = start + cols < hidden
            r = _row(x_row, res_row, start + cols, mask, stride_xd, stride_rd, HAS_RESIDUAL, SOFT_BF16)
            if HAS_RESIDUAL:
                tl.store(res_row + (start + cols) * stride_rd, r.to(dtype), mask=mask)
            y = _normed(r, inv, w_ptr, start + cols, mask, stride_w, dtype, out_dtype, SOFT_BF16)
            tl.store(out_row + (start + cols) * stride_od, y.to(out_dtype), mask=mask)


def _tiling(hidden: int, block: int | None) -> dict:
    block = block or min(MAX_BLOCK, triton.next_power_of_2(hidden))
    # ~8-16 elements a thread: enough loads in flight per thread without spilling a 8k-wide row
    return {"BLOCK": block, "SINGLE_PASS": block >= hidden, "num_warps": max(1, min(16, block // 256)),
            "enable_fp_fusion": False}


def plan_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor, on_gpu: bool, block: int | None = None
) -> list[Launch]:
    if x.dim() not in (2, 3) or weight.shape != (x.shape[-1],):
        raise ValueError(f"rms_norm: x {tuple(x.shape)} must be [n, hidden] or [n, heads, hidden] with weight "
                         f"[hidden], got weight {tuple(weight.shape)}")
    if out.shape != x.shape:
        raise ValueError(f"rms_norm: out {tuple(out.shape)} must have x's shape {tuple(x.shape)}")
    if x.numel() == 0:
        return []
    x3 = x if x.dim() == 3 else x.unsqueeze(1)
    out3 = out if out.dim() == 3 else out.unsqueeze(1)
    args = (
        x3, x3, weight, out3,
        *x3.stride(), 0, 0, *out3.stride(),
        weight.stride(0), x.shape[-1], eps,
    )
    meta = {**_tiling(x.shape[-1], block), "HAS_RESIDUAL": False, "SOFT_BF16": not on_gpu}
    return [Launch(_rms_norm_kernel, (x3.shape[0], x3.shape[1]), args, meta)]


def plan_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, on_gpu: bool,
    block: int | None = None,
) -> list[Launch]:
    if x.dim() != 2 or residual.shape != x.shape or weight.shape != (x.shape[1],):
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)}, residual {tuple(residual.shape)} must be [n, hidden], "
                         f"weight {tuple(weight.shape)} [hidden]")
    if residual.dtype != x.dtype:
        raise ValueError(f"add_rms_norm: x {x.dtype} and residual {residual.dtype} must share a dtype")
    if x.numel() and x.data_ptr() == residual.data_ptr():
        raise ValueError("add_rms_norm: x and residual are both written, they must not be the same memory")
    if x.numel() == 0:
        return []
    args = (
        x, residual, weight, x,  # x is also the output: normalised in place
        x.stride(0), 0, x.stride(1), *residual.stride(), x.stride(0), 0, x.stride(1),
        weight.stride(0), x.shape[1], eps,
    )
    meta = {**_tiling(x.shape[1], block), "HAS_RESIDUAL": True, "SOFT_BF16": not on_gpu}
    return [Launch(_rms_norm_kernel, (x.shape[0], 1), args, meta)]


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, out: torch.Tensor | None = None, block: int | None = None
) -> torch.Tensor:
    """weight * normalised x, in `out` (x itself for in place; new and contiguous if None); see module doc.
    `block` (a power of two) forces the chunk width, for tests."""
    check_launchable(_rms_norm_kernel, x)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    for launch in plan_rms_norm(x, weight, eps, out, x.is_cuda, block):
        launch()
    return out


def add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *, block: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: residual += x, then x = weight * rms_norm(residual). Returns (x, residual); see module doc."""
    check_launchable(_rms_norm_kernel, x)
    for launch in plan_add_rms_norm(x, residual, weight, eps, x.is_cuda, block):
        launch()
    return x, residual
