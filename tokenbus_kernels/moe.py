"""Triton kernel: the experts of a mixture-of-experts layer as two grouped GEMMs over tokens sorted by expert.

fused_moe_triton(x, w13, w2, topk_weights, topk_ids) -> out [num_tokens, hidden]
  x            [num_tokens, hidden]
  w13          [num_experts, 2 * inter, hidden]  gate rows then up rows, nn.Linear layout (any strides)
  w2           [num_experts, hidden, inter]
  topk_weights [num_tokens, top_k] (float32 from the router), topk_ids int64 [num_tokens, top_k]
  out[t] = sum_k topk_weights[t, k] * w2[e] @ (silu(w13[e, :inter] @ x[t]) * (w13[e, inter:] @ x[t])),
           e = topk_ids[t, k]
tokenbus_kernels/moe_reference.py (fused_moe_ref) is the definition of correct.

How: the num_tokens * top_k (token, slot) pairs are sorted by expert and each expert's run padded to a multiple
of BLOCK_M (moe_align: torch ops on the device, no host sync, fixed upper-bound sizes, so CUDA-graph safe).
Every BLOCK_M tile then belongs to one expert (block_experts; -1 for the tail past the last real tile), and
  GEMM 1  gate_up[pair] = x[pair // top_k] @ w13[e]^T          [num_pairs, 2 * inter]
  SiLU·mul (tokenbus_kernels/activation.py)                             [num_pairs, inter]
  GEMM 2  down[pair]    = topk_weight[pair] * h[pair] @ w2[e]^T [num_pairs, hidden]
  out = down.view(num_tokens, top_k, hidden).sum(1)
_moe_gemm_kernel is both GEMMs: grid (max tiles, cdiv(N, BLOCK_N)); a tile gathers its rows of A through the
sorted pair ids (padding ids = num_pairs are masked), multiplies by its expert's weight, scatters the rows back.
An expert with no tokens gets no tile. fp32 inputs use IEEE fp32 dot products (no TF32), so the float32 engine
matches transformers token for token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenbus_kernels.activation import silu_and_mul_triton
from tokenbus_kernels.launch import Launch, check_launchable


@triton.jit
def _moe_gemm_kernel(
    a_ptr, w_ptr, out_ptr, weights_ptr, sorted_ids_ptr, block_experts_ptr,
    num_pairs, N, K,
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_om, stride_on,
    A_ROW_DIV: tl.constexpr, MUL_WEIGHT: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Grid (max tiles, cdiv(N, BLOCK_N)): out[pairs of tile m, n-tile] = A[rows] @ w[expert]^T (* weight)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    if expert < 0:  # past the last expert's padded run
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ids_ptr + offs_m)
    valid = pairs < num_pairs
    a_rows = (pairs // A_ROW_DIV).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_base = w_ptr + expert * stride_we
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak,
                    mask=valid[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk,
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
    if MUL_WEIGHT:
        # transformers rounds the expert's output to the dtype, then scales by the fp32 routing weight
        weight = tl.load(weights_ptr + pairs, mask=valid, other=0.0).to(tl.float32)
        acc = acc.to(out_ptr.dtype.element_ty).to(tl.float32) * weight[:, None]
    out_ptrs = out_ptr + pairs.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


def block_m_for(num_pairs: int) -> int:
    # decode-sized batches: small tiles waste less on each expert's padding; prefill: bigger tiles reuse weights
    return 16 if num_pairs <= 1024 else 64


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_ids int32 [max_padded], block_experts int32 [max_padded // block_m]).

    sorted_ids lists the pair ids (token * top_k + slot) expert by expert, each expert's run padded with
    num_pairs up to a multiple of block_m; block_experts names each tile's expert (-1 past the last run).
    max_padded = num_pairs + num_experts * (block_m - 1) rounded up: the most any routing can need."""
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    device = flat.device
    max_padded = -(-(num_pairs + num_experts * (block_m - 1)) // block_m) * block_m
    # scatter_add, not bincount: bincount's output size depends on the data (a host sync, no graph capture)
    counts = torch.zeros(num_experts, dtype=torch.long, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    rank = torch.arange(num_pairs, device=device) - (torch.cumsum(counts, 0) - counts)[sorted_experts]
    dest = (padded_end - padded)[sorted_experts] + rank
    sorted_ids = torch.full((max_padded,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids.index_put_((dest,), order.to(torch.int32))
    tile_starts = torch.arange(0, max_padded, block_m, device=device)
    block_experts = torch.searchsorted(padded_end, tile_starts, right=True).to(torch.int32)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1).to(torch.int32)
    return sorted_ids, block_experts


def plan_moe_gemm(
    a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, weights: torch.Tensor, sorted_ids: torch.Tensor,
    block_experts: torch.Tensor, num_pairs: int, a_row_div: int, mul_weight: bool, block_m: int,
    on_gpu: bool, block_n: int | None = None, block_k: int | None = None,
) -> list[Launch]:
    """One grouped GEMM: out[pair] = a[pair // a_row_div] @ w[expert of pair]^T (* weights[pair])."""
    if w.dim() != 3 or a.shape[1] != w.shape[2] or out.shape[1] != w.shape[1]:
        raise ValueError(f"moe gemm: a {tuple(a.shape)}, w {tuple(w.shape)}, out {tuple(out.shape)} do not fit "
                         "a [rows, K], w [experts, N, K], out [pairs, N]")
    if num_pairs == 0:
        return []
    n, k = w.shape[1], w.shape[2]
    # the interpreter pays per program and per op, not per element: one wide tile there
    widest = 64 if on_gpu else 256
    block_n = block_n or min(widest, max(16, triton.next_power_of_2(n)))
    block_k = block_k or min(widest, max(16, triton.next_power_of_2(k)))
    precision = "ieee" if a.dtype == torch.float32 else "tf32"
    args = (a, w, out, weights, sorted_ids, block_experts, num_pairs, n, k, *a.stride(), *w.stride(), *out.stride())
    meta = {"A_ROW_DIV": a_row_div, "MUL_WEIGHT": mul_weight, "INPUT_PRECISION": precision, "BLOCK_M": block_m,
            "BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": 4}
    return [Launch(_moe_gemm_kernel, (block_experts.numel(), triton.cdiv(n, block_n)), args, meta)]


def fused_moe_triton(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    block_m: int | None = None, block_n: int | None = None, block_k: int | None = None,
) -> torch.Tensor:
    """The experts' weighted sum [num_tokens, hidden]; see the module doc. block_m/n/k force the tiles (tests)."""
    check_launchable(_moe_gemm_kernel, x)
    num_tokens, top_k = topk_ids.shape
    num_experts, inter = w13.shape[0], w2.shape[2]
    if w13.shape[1] != 2 * inter or w2.shape[:2] != (num_experts, x.shape[1]):
        raise ValueError(f"fused_moe: w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} must be "
                         f"[experts, 2 * inter, {x.shape[1]}] and [experts, {x.shape[1]}, inter]")
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    block_m = block_m or block_m_for(num_pairs)
    sorted_ids, block_experts = moe_align(topk_ids, num_experts, block_m)
    weights = topk_weights.reshape(-1).contiguous()
    gate_up = torch.empty(num_pairs, 2 * inter, dtype=x.dtype, device=x.device)
    for launch in plan_moe_gemm(x, w13, gate_up, weights, sorted_ids, block_experts, num_pairs, top_k, False,
                                block_m, x.is_cuda, block_n, block_k):
        launch()
    h = silu_and_mul_triton(gate_up)
    down = torch.empty(num_pairs, x.shape[1], dtype=x.dtype, device=x.device)
    for launch in plan_moe_gemm(h, w2, down, weights, sorted_ids, block_experts, num_pairs, 1, True, block_m,
                                x.is_cuda, block_n, block_k):
        launch()
    return down.view(num_tokens, top_k, -1).sum(dim=1)
