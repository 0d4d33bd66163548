"""Triton kernels: LoRA shrink (x·A) and expand (·B) over a batch whose rows use different adapters, grouped by
adapter slot (SGMV): tokenbus_kernels/lora_reference.py has the layout and the PyTorch reference.

lora_shrink_triton(x, a, rows, starts, counts, max_count, out) -> out
  x [T, in], a [S, K, in], out [T, K]: out[r] = x[r] @ a[s].T for every row r of slot s (rows[starts[s] :
  starts[s] + counts[s]]); other rows of out untouched.
lora_expand_triton(y, t, b, slices, rows, starts, counts, max_count) -> y
  y [T, out] += t[r, j*R:(j+1)*R] @ b[s, off_j:off_j+w_j].T on the columns of slice j, for each slice, in place.

Grid (cdiv(max_count, BLOCK_M), column tiles, S): program (m, n, s) takes rows m*BLOCK_M.. of slot s's group
and exits at once when the group is shorter (an empty group costs one load). max_count bounds every group:
the step's largest group (eager), or the padded row count (a CUDA graph: then the grid is fixed and the
groups are read from device tensors, so one graph serves any mix of adapters). Rows are gathered through
`rows`, so the batch is never permuted. fp32 dots run in IEEE fp32 (no TF32): PEFT's fp32 reference; bf16 /
fp16 ones natively on the GPU, widened to fp32 under the interpreter. Nothing is read back to the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenbus_kernels.launch import Launch, check_launchable

BLOCK_M = 16
BLOCK_N = 32  # output columns of a program (shrink: of K; expand: of a slice)
BLOCK_K = 32  # the reduction's step (shrink: over in; expand: over the rank)


@triton.jit
def _sgmv_kernel(in_ptr, w_ptr, out_ptr, rows_ptr, starts_ptr, counts_ptr, N, K,
                 stride_im, stride_ik, stride_ws, stride_wn, stride_wk, stride_om, stride_on,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
                 ADD: tl.constexpr):
    """out[r, n] (=, or += with ADD) sum_k in[r, k] * w[slot, n, k] for the rows r of each slot's group: the
    shrink (in = x, w = a, out = t) and the expand of one slice (in = t's rank block, w = b's rows, out = y's
    columns, ADD)."""
    slot = tl.program_id(2)
    count = tl.load(counts_ptr + slot)
    m0 = tl.program_id(0) * BLOCK_M
    if m0 < count:
        start = tl.load(starts_ptr + slot)
        offs_m = m0 + tl.arange(0, BLOCK_M)
        row_ok = offs_m < count
        rows = tl.load(rows_ptr + start + offs_m, mask=row_ok, other=0).to(tl.int64)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = offs_n < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        w_base = w_ptr + slot.to(tl.int64) * stride_ws
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            it = tl.load(in_ptr + rows[:, None] * stride_im + offs_k[None, :] * stride_ik,
                         mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            wt = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk,
                         mask=col_ok[None, :] & k_ok[:, None], other=0.0)
            if IEEE:  # fp32, or half precision widened (the interpreter's dot takes no bf16)
                acc = tl.dot(it.to(tl.float32), wt.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(it, wt, acc)
        out_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :] * stride_on
        mask = row_ok[:, None] & col_ok[None, :]
        dtype = out_ptr.dtype.element_ty
        if ADD:
            # the delta rounded to the model dtype before the add, as PEFT's `result + lora_B(...) * scaling`
            y = tl.load(out_ptrs, mask=mask, other=0.0)
            tl.store(out_ptrs, (y.to(tl.float32) + acc.to(dtype).to(tl.float32)).to(dtype), mask=mask)
        else:
            tl.store(out_ptrs, acc.to(dtype), mask=mask)


def _check(x: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor, num_slots: int) -> None:
    if rows.dtype != torch.int64 or starts.dtype != torch.int32 or counts.dtype != torch.int32:
        raise ValueError(f"lora: rows must be int64 and starts, counts int32; got {rows.dtype}, {starts.dtype}, "
                         f"{counts.dtype}")
    if starts.shape != (num_slots,) or counts.shape != (num_slots,):
        raise ValueError(f"lora: starts and counts must be [{num_slots}] (one per slot), got "
                         f"{tuple(starts.shape)}, {tuple(counts.shape)}")


def _meta(x: torch.Tensor, add: bool, on_gpu: bool | None) -> dict:
    # IEEE: fp32 dots in fp32 (PEFT's reference), and under the interpreter every dtype widened to fp32
    on_gpu = x.is_cuda if on_gpu is None else on_gpu
    return {"BLOCK_M": BLOCK_M, "BLOCK_N": BLOCK_N, "BLOCK_K": BLOCK_K,
            "IEEE": x.dtype == torch.float32 or not on_gpu, "ADD": add}


def plan_shrink(x: torch.Tensor, a: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor,
                max_count: int, out: torch.Tensor, on_gpu: bool | None = None) -> list[Launch]:
    """on_gpu: plan for the GPU whatever the tensors' device (tests compile the GPU plan without one)."""
    num_slots, k, in_features = a.shape
    _check(x, rows, starts, counts, num_slots)
    if x.shape[1] != in_features or out.shape != (x.shape[0], k):
        raise ValueError(f"lora shrink: x {tuple(x.shape)}, a {tuple(a.shape)}, out {tuple(out.shape)} disagree")
    if max_count == 0 or x.shape[0] == 0:
        return []
    grid = (triton.cdiv(max_count, BLOCK_M), triton.cdiv(k, BLOCK_N), num_slots)
    args = (x, a, out, rows, starts, counts, k, in_features, *x.stride(), *a.stride(), *out.stride())
    return [Launch(_sgmv_kernel, grid, args, _meta(x, False, on_gpu))]


def plan_expand(y: torch.Tensor, t: torch.Tensor, b: torch.Tensor, slices: tuple[tuple[int, int], ...],
                rows: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor, max_count: int,
                on_gpu: bool | None = None) -> list[Launch]:
    num_slots, out_features, rank = b.shape
    _check(y, rows, starts, counts, num_slots)
    if y.shape[1] != out_features or t.shape != (y.shape[0], len(slices) * rank):
        raise ValueError(f"lora expand: y {tuple(y.shape)}, t {tuple(t.shape)}, b {tuple(b.shape)} and "
                         f"{len(slices)} slices disagree")
    if max_count == 0 or y.shape[0] == 0:
        return []
    meta = _meta(y, True, on_gpu)
    launches = []
    for j, (offset, width) in enumerate(slices):  # views: one launch a slice, no copy
        ys, ts, bs = y[:, offset : offset + width], t[:, j * rank : (j + 1) * rank], b[:, offset : offset + width]
        grid = (triton.cdiv(max_count, BLOCK_M), triton.cdiv(width, BLOCK_N), num_slots)
        args = (ts, bs, ys, rows, starts, counts, width, rank, *ts.stride(), *bs.stride(), *ys.stride())
        launches.append(Launch(_sgmv_kernel, grid, args, meta))
    return launches


def lora_shrink_triton(x: torch.Tensor, a: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor,
                       counts: torch.Tensor, max_count: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """out [T, K] with every adapter row's x @ a[slot].T (see the module doc); allocated if None."""
    check_launchable(_sgmv_kernel, x)
    if out is None:
        out = torch.empty(x.shape[0], a.shape[1], dtype=x.dtype, device=x.device)
    for launch in plan_shrink(x, a, rows, starts, counts, max_count, out):
        launch()
    return out


def lora_expand_triton(y: torch.Tensor, t: torch.Tensor, b: torch.Tensor, slices: tuple[tuple[int, int], ...],
                       rows: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor, max_count: int) -> torch.Tensor:
    """y += every adapter row's delta, slice by slice, in place (see the module doc). Returns y."""
    check_launchable(_sgmv_kernel, y)
    for launch in plan_expand(y, t, b, slices, rows, starts, counts, max_count):
        launch()
    return y
