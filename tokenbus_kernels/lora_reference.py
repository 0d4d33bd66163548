"""Plain PyTorch LoRA over a batch whose rows use different adapters: the definition of "correct" for
tokenbus_kernels/lora.py, and the CPU serving path (grouped torch matmuls, one pair per adapter that has rows).

Layout (shared with the Triton kernels):
  x        [num_tokens, in]             a linear layer's input
  y        [num_tokens, out]            its output, to which each adapter row's delta is added in place
  a        [num_slots, K, in]           per resident adapter slot its shrink weights: PEFT's lora_A rows,
                                        slice after slice (K = num_slices * max_rank), zero past its rank
  b        [num_slots, out, max_rank]   its expand weights: PEFT's lora_B times the adapter's scaling
                                        (alpha / r, or alpha / sqrt(r) with rsLoRA), zero past its rank
  slices   ((offset, width), ...)       the output columns each slice of a fused linear covers (q, k, v of
                                        qkv_proj; gate, up of gate_up_proj); one (0, out) for the others
  rows     int64 [num_adapter_rows]     the rows that use an adapter, sorted by slot (stable: in row order)
  starts   int32 [num_slots]            slot s's rows are rows[starts[s] : starts[s] + counts[s]]
  counts   int32 [num_slots]            0 for a slot no row uses this step (an empty group)
Rows of no adapter (the base model) are in no group: y keeps the base output there.

shrink: t[r, j * R : (j + 1) * R] = x[r] @ a[s, j * R : (j + 1) * R].T     (SGMV shrink, one GEMM per slot)
expand: y[r, off_j : off_j + w_j] += t[r, j * R : (j + 1) * R] @ b[s, off_j : off_j + w_j].T
The rounding follows PEFT's eager `lora_B(lora_A(x))`: t in the model dtype, the delta in the model dtype,
then added to y.
"""

from __future__ import annotations

import torch

Slices = tuple[tuple[int, int], ...]


def lora_shrink_ref(x: torch.Tensor, a: torch.Tensor, rows: torch.Tensor, groups: list[tuple[int, int, int]],
                    out: torch.Tensor) -> torch.Tensor:
    """out[rows of slot s] = x[those rows] @ a[s].T for each (slot, start, count) in groups; other rows of
    out are left as they are."""
    for slot, start, count in groups:
        idx = rows[start : start + count]
        out.index_copy_(0, idx, x.index_select(0, idx) @ a[slot].T)
    return out


def lora_expand_ref(y: torch.Tensor, t: torch.Tensor, b: torch.Tensor, slices: Slices, rows: torch.Tensor,
                    groups: list[tuple[int, int, int]]) -> torch.Tensor:
    """y[rows of slot s, slice j] += t[those rows, slice j's rank block] @ b[s, slice j's columns].T (in place)."""
    rank = b.shape[2]
    for slot, start, count in groups:
        idx = rows[start : start + count]
        ts = t.index_select(0, idx)
        for j, (offset, width) in enumerate(slices):
            delta = ts[:, j * rank : (j + 1) * rank] @ b[slot, offset : offset + width].T
            y[:, offset : offset + width].index_add_(0, idx, delta)
    return y


def lora_apply_ref(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slices: Slices,
                   rows: torch.Tensor, groups: list[tuple[int, int, int]]) -> torch.Tensor:
    """y += every adapter row's LoRA delta (shrink then expand), group by group: the CPU serving path. Only the
    groups' rows are gathered; no [num_tokens, K] intermediate."""
    rank = b.shape[2]
    for slot, start, count in groups:
        idx = rows[start : start + count]
        t = x.index_select(0, idx) @ a[slot].T
        for j, (offset, width) in enumerate(slices):
            delta = t[:, j * rank : (j + 1) * rank] @ b[slot, offset : offset + width].T
            y[:, offset : offset + width].index_add_(0, idx, delta)
    return y


def lora_ref(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slices: Slices,
             rows: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """y += every adapter row's LoRA delta, from the device-side layout (starts, counts as tensors): the kernels'
    shrink then expand, as references."""
    groups = groups_of(starts, counts)
    t = torch.zeros(x.shape[0], a.shape[1], dtype=x.dtype, device=x.device)
    return lora_expand_ref(y, lora_shrink_ref(x, a, rows, groups, t), b, slices, rows, groups)


def groups_of(starts: torch.Tensor, counts: torch.Tensor) -> list[tuple[int, int, int]]:
    """The non-empty groups as (slot, start, count)."""
    return [(s, st, c) for s, (st, c) in enumerate(zip(starts.tolist(), counts.tolist(), strict=True)) if c > 0]


def sort_rows_by_slot(slots: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From each row's slot (-1 = no adapter): (rows sorted by slot, starts, counts) as the kernels take them."""
    used = torch.nonzero(slots >= 0).flatten()
    rows = used[torch.argsort(slots[used], stable=True)]
    counts = torch.bincount(slots[used], minlength=num_slots).to(torch.int32)
    starts = (torch.cumsum(counts, 0) - counts).to(torch.int32)
    return rows, starts, counts
