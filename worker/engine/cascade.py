"""When cascade decode attention pays, and each decode step's layout (tokenbus_kernels/cascade.py).

The block manager names the groups of decode rows whose tables start with the same physical blocks
(BlockManager.prefix_groups); CascadePlanner keeps the groups the cost rule accepts and builds the step's
CascadeLayout, which the backend's decode attention then reads (C++, Triton or the reference).

The cost rule, counted in KV tokens read (the decode kernels' floor is memory traffic): a group of n rows
behind p shared tokens reads p once instead of n times, saving (n - 1) * p; what it adds is, per row, a
partial softmax written and merged (a head_dim vector per query head and chunk) and a second, short walk
over its own blocks, charged MERGE_COST_TOKENS tokens. So a group cascades when (n - 1) * p > n *
MERGE_COST_TOKENS: a pair needs a prefix of more than 64 tokens, a large group more than ~32. The constant
is an estimate, not a measurement (benchmarks/e2e/cascade.py makes it, on a quiet machine).

Modes (EngineConfig.cascade_attention): "auto" the rule; "off" never; "on" every group the block manager
names, and every other decode row with a full block before its newest token as a group of one: each row's
attention then goes through the cascade path (the parity tests force it so).

CUDA graphs (worker/engine/cuda_graphs.py): with the mode not "off", each (rows, table width) shape gets a
second graph, captured over a static layout padded to group_capacity(mode, rows) groups (CascadeLayout's
padded form: the kernels read the layout on the device and their grids depend only on its shapes). A padded
step whose planner chose groups builds its layout at that capacity, copies it into the static one and
replays the cascade graph; one with no group replays the plain graph.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from tokenbus_kernels.cascade import CascadeLayout
from worker.engine.block_manager import BlockManager
from worker.engine.config import CASCADE_MODES
from worker.engine.sequence import Sequence

MERGE_COST_TOKENS = 32  # what cascading adds per row, in KV tokens read (module docstring)


def pays(members: int, prefix_tokens: int) -> bool:
    """Whether a group of `members` rows behind `prefix_tokens` shared tokens reads less as a cascade."""
    return members >= 2 and (members - 1) * prefix_tokens > members * MERGE_COST_TOKENS


def group_capacity(mode: str, rows: int) -> int:
    """The most groups the planner can choose among `rows` rows (a cascade graph's static layout holds that
    many): "auto" cascades groups of two or more, "on" groups of one too, "off" none."""
    return {"auto": rows // 2, "on": rows, "off": 0}[mode]


@dataclass
class CascadeStats:
    """Counters over every decode step since the engine started (EngineStats carries them)."""

    steps: int = 0  # decode steps whose attention ran as a cascade
    groups: int = 0  # groups cascaded, summed over those steps
    grouped_rows: int = 0  # rows in those groups, summed over those steps
    kv_tokens_read: int = 0  # KV tokens the decode attention read, per layer, summed over decode steps
    kv_tokens_plain: int = 0  # what plain decode attention would have read


class CascadePlanner:
    def __init__(self, block_manager: BlockManager, mode: str = "auto") -> None:
        if mode not in CASCADE_MODES:
            raise ValueError(f"cascade_attention must be one of {list(CASCADE_MODES)}, got {mode!r}")
        self.block_manager = block_manager
        self.mode = mode
        self.stats = CascadeStats()

    def group_capacity(self, rows: int) -> int:
        return group_capacity(self.mode, rows)

    def layout(self, decode: list[Sequence], lens: Seq[int], num_rows: int, device: torch.device,
               capacity: int | None = None) -> CascadeLayout | None:
        """The layout of a step whose decode rows are `decode` (lens: each one's tokens in the cache, its
        new one included; num_rows: with padding rows after them), or None to run plain decode. capacity: padded
        to that many groups (a cascade graph's static layout)."""
        chosen = self.choose(decode, lens)
        return CascadeLayout.build(chosen, num_rows, device, capacity) if chosen else None

    def choose(self, decode: list[Sequence], lens: Seq[int]) -> list[tuple[list[int], int]]:
        """The groups (member rows, prefix tokens) the step's decode rows cascade in (empty: plain decode),
        counted in the stats; StepInputs packs them into the step's one host-to-device copy."""
        lens = [int(n) for n in lens[: len(decode)]]
        plain = sum(lens)
        self.stats.kv_tokens_plain += plain
        chosen: list[tuple[list[int], int]] = []
        if self.mode != "off" and decode:
            bs = self.block_manager.block_size
            forced = self.mode == "on"
            for group in self.block_manager.prefix_groups(decode):
                prefix = group.num_blocks * bs
                if forced or pays(len(group.members), prefix):
                    chosen.append((group.members, prefix))
            if forced:
                taken = {r for members, _ in chosen for r in members}
                chosen += [([i], (n - 1) // bs * bs) for i, n in enumerate(lens) if i not in taken and n > bs]
        saved = sum((len(members) - 1) * prefix for members, prefix in chosen)
        self.stats.kv_tokens_read += plain - saved
        if chosen:
            self.stats.steps += 1
            self.stats.groups += len(chosen)
            self.stats.grouped_rows += sum(len(members) for members, _ in chosen)
        return chosen
