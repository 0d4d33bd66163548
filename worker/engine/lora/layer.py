"""LoraLinear: a base linear with the step's adapter deltas added to its output, and the step's grouping of rows
by adapter slot (LoraBatch) that every wrapped linear of the model reads.

The wrapper leaves the base linear as it is (nn.Linear, CpuLinear, an FP8 or int8 one): y = base(x), then
for the rows that use an adapter y += (x · A_slot) · B_slot through the backend (tokenbus_kernels/lora*.py). A step
with no adapter row sets no batch and costs nothing. The batch is set once per forward on the LoraState the
wrappers share (ModelRunner); a CUDA graph captures it as static tensors, refilled per replay.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from tokenbus_kernels.lora_reference import Slices


@dataclass
class LoraBatch:
    """The rows of a step that use an adapter, grouped by slot (tokenbus_kernels/lora_reference.py's layout)."""

    rows: torch.Tensor  # int64 [adapter rows], sorted by slot
    starts: torch.Tensor  # int32 [num_slots]
    counts: torch.Tensor  # int32 [num_slots]
    max_count: int  # bounds every group: the kernels' grid (a graph's padded row count)
    groups: list[tuple[int, int, int]]  # host copy of the non-empty groups (slot, start, count): the CPU path

    @staticmethod
    def plan(slots: np.ndarray, num_slots: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """(rows, starts, counts) from each row's slot (-1 = the base model); None when no row has one."""
        used = np.flatnonzero(slots >= 0)
        if not len(used):
            return None
        rows = used[np.argsort(slots[used], kind="stable")]
        counts = np.bincount(slots[used], minlength=num_slots)
        return rows, np.cumsum(counts) - counts, counts


class LoraState:
    """What every LoraLinear of a model shares: the current step's batch (None: no adapter row)."""

    def __init__(self, num_slots: int = 0) -> None:
        self.batch: LoraBatch | None = None
        # each slot's adapter rank (0: empty), on the host: the CPU kernel computes no more of max_lora_rank
        self.slot_ranks = torch.zeros(num_slots, dtype=torch.int32)


class LoraLinear(nn.Module):
    def __init__(self, base: nn.Module, a: torch.Tensor, b: torch.Tensor, slices: Slices, state: LoraState,
                 backend) -> None:
        super().__init__()
        self.base = base
        self.a, self.b = a, b  # [slots, slices * max_rank, in], [slots, out, max_rank]: the manager fills them
        self.slices = slices
        self.state = state
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        batch = self.state.batch
        if batch is not None:
            self.backend.lora(y, x, self.a, self.b, self.slices, batch)
        return y
