"""The pool of fixed-size KV-cache blocks and each sequence's block table."""

from __future__ import annotations

from collections import deque

from worker.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache must hold at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_ids)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_missing(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks seq still needs so its cache can hold num_new_tokens more tokens."""
        return max(0, self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_missing(seq, num_new_tokens) <= self.num_free

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        missing = self.num_missing(seq, num_new_tokens)
        if missing > self.num_free:
            raise RuntimeError(f"asked for {missing} KV blocks with {self.num_free} free")
        for _ in range(missing):
            block_id = self.free_ids.popleft()
            assert self.ref_counts[block_id] == 0
            self.ref_counts[block_id] = 1
            seq.block_table.append(block_id)

    def free(self, seq: Sequence) -> None:
        # reversed: the tail blocks go back first and are handed out last, keeping hot blocks warm
        for block_id in reversed(seq.block_table):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_ids.append(block_id)
        seq.block_table = []
        seq.num_computed_tokens = 0
