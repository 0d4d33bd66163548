"""The pool of fixed-size KV-cache blocks, each sequence's block table, and the prefix cache.

Prefix caching: once a block is full and its K/V computed, it is keyed by a hash of (its parent block's
hash, its token ids), so the key names the whole prefix up to the block's end. The first block's parent is
the sequence's cache_salt (its LoRA adapter's; None for the base model): K/V computed under one adapter are
never served to another, nor to the base model, even for the same tokens. A new sequence takes every
cached full block its tokens start with (the ref count goes up) and computes only the rest. A block whose
count drops to 0 keeps its key and waits in an LRU; allocation takes never-hashed free blocks first and
evicts the least recently freed cached block only when none is left. A block is shared only while it is
full and read-only, so no sequence ever writes into a block another one reads.

The same sharing gives cascade decode attention its groups (prefix_groups): running sequences whose tables
start with the same physical blocks read those blocks' K/V once per step between them (tokenbus_kernels/cascade.py).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from dataclasses import dataclass

from worker.engine.sequence import Sequence


def block_hash(parent: bytes | None, token_ids: list[int]) -> bytes:
    """The key of a full block: blake2b over the parent block's key and the block's token ids."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"\0" * 16)
    h.update(b"".join(t.to_bytes(4, "little") for t in token_ids))
    return h.digest()


@dataclass
class PrefixCacheStats:
    queried_tokens: int = 0  # prompt tokens of admitted sequences (a preempted one counts again)
    hit_tokens: int = 0  # of those, served from cached blocks
    queried_blocks: int = 0  # full blocks those sequences could have reused
    hit_blocks: int = 0
    evictions: int = 0  # cached blocks handed out again for other tokens


@dataclass
class PrefixGroup:
    """Sequences whose block tables start with the same `num_blocks` physical blocks (full, read-only)."""

    members: list[int]  # indices into the sequences prefix_groups was asked about, in their order
    num_blocks: int


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache must hold at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.free_ids: deque[int] = deque(range(num_blocks))  # free and holding no cached prefix
        self.cached_free: OrderedDict[int, None] = OrderedDict()  # free but cached: oldest first (LRU)
        self.block_keys: list[bytes | None] = [None] * num_blocks
        self.key_to_block: dict[bytes, int] = {}
        self.stats = PrefixCacheStats()

    @property
    def num_free(self) -> int:
        return len(self.free_ids) + len(self.cached_free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self.key_to_block)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- admission (a sequence holding no blocks) ----------------------------------------------------------

    def match_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks seq's tokens start with. At most (num_tokens - 1) // block_size of them: the last
        token is always computed, so the step that admits seq has the logits it samples from."""
        if not self.enable_prefix_caching or seq.block_table or not seq.reads_prefix_cache:
            return []
        bs = self.block_size
        hits: list[int] = []
        parent = seq.cache_salt
        for i in range((seq.num_tokens - 1) // bs):
            key = block_hash(parent, seq.token_ids[i * bs : (i + 1) * bs])
            block_id = self.key_to_block.get(key)
            if block_id is None:
                break
            hits.append(block_id)
            parent = key
        return hits

    def can_admit(self, seq: Sequence, hits: list[int], num_new_tokens: int) -> bool:
        """Whether seq can take `hits` and get room for num_new_tokens past them."""
        revived = sum(1 for b in hits if self.ref_counts[b] == 0)  # hits waiting in the LRU leave it
        missing = self.blocks_for(len(hits) * self.block_size + num_new_tokens) - len(hits)
        return missing + revived <= self.num_free

    def admit(self, seq: Sequence, hits: list[int]) -> None:
        """Give seq the cached blocks `hits` (from match_prefix): their tokens count as computed."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        for block_id in hits:
            if self.ref_counts[block_id] == 0:
                del self.cached_free[block_id]
            self.ref_counts[block_id] += 1
            seq.block_table.append(block_id)
            seq.block_keys.append(self.block_keys[block_id])
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.num_cached_tokens = seq.num_computed_tokens
        if self.enable_prefix_caching and seq.reads_prefix_cache:
            s = self.stats
            s.queried_tokens += seq.num_tokens
            s.hit_tokens += seq.num_computed_tokens
            s.queried_blocks += seq.num_tokens // self.block_size
            s.hit_blocks += len(hits)

    # ---- growth -------------------------------------------------------------------------------------------

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
            block_id = self._take_free()
            self.ref_counts[block_id] = 1
            seq.block_table.append(block_id)

    def _take_free(self) -> int:
        if self.free_ids:
            block_id = self.free_ids.popleft()
        else:
            block_id, _ = self.cached_free.popitem(last=False)
            key = self.block_keys[block_id]
            self.block_keys[block_id] = None
            if key is not None and self.key_to_block.get(key) == block_id:
                del self.key_to_block[key]
            self.stats.evictions += 1
        assert self.ref_counts[block_id] == 0
        return block_id

    def commit(self, seq: Sequence) -> None:
        """After a step: key seq's blocks that are now full and computed, so later sequences can reuse them."""
        if not self.enable_prefix_caching or not seq.writes_prefix_cache:
            return
        bs = self.block_size
        for i in range(len(seq.block_keys), seq.num_computed_tokens // bs):
            parent = seq.block_keys[i - 1] if i else seq.cache_salt
            key = block_hash(parent, seq.token_ids[i * bs : (i + 1) * bs])
            seq.block_keys.append(key)
            block_id = seq.block_table[i]
            # the same prefix computed twice at once: the first copy stays the cached one
            if key not in self.key_to_block and self.block_keys[block_id] is None:
                self.key_to_block[key] = block_id
                self.block_keys[block_id] = key

    # ---- sharing ------------------------------------------------------------------------------------------

    def prefix_groups(self, seqs: list[Sequence]) -> list[PrefixGroup]:
        """The groups (two or more) of seqs whose leading blocks are the same physical blocks, each with how
        many they all hold: the longest common start of their tables. Two tables name one block only through
        the prefix cache, so those blocks are full and computed. Groups by first block, in order of their
        first member; a sequence that shares its first block with no other one of seqs is in none."""
        by_first: dict[int, list[int]] = {}
        ref_counts = self.ref_counts
        for i, seq in enumerate(seqs):
            table = seq.block_table
            if table and ref_counts[table[0]] > 1:  # held once: no other table starts with it
                by_first.setdefault(table[0], []).append(i)
        groups = []
        for members in by_first.values():
            if len(members) < 2:
                continue
            head = seqs[members[0]].block_table
            shared = len(head)
            for i in members[1:]:
                table = seqs[i].block_table
                shared = min(shared, len(table))
                j = 1  # block 0 is the same by construction
                while j < shared and table[j] == head[j]:
                    j += 1
                shared = j
            groups.append(PrefixGroup(members, shared))
        return groups

    # ---- release ------------------------------------------------------------------------------------------

    def free(self, seq: Sequence) -> None:
        # reversed: the tail blocks go back first, so the LRU evicts them before the prefix they extend
        for block_id in reversed(seq.block_table):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                if self.block_keys[block_id] is not None:
                    self.cached_free[block_id] = None
                else:
                    self.free_ids.append(block_id)
        seq.block_table = []
        seq.block_keys = []
        seq.num_computed_tokens = 0

    def check_invariants(self, live: list[Sequence] = ()) -> None:
        """Raise AssertionError unless the counts match the live sequences' tables: each block is free,
        cached-free, or held exactly as often as the tables name it."""
        held = [0] * self.num_blocks
        for seq in live:
            for block_id in seq.block_table:
                held[block_id] += 1
        assert held == self.ref_counts, "ref counts differ from the live block tables"
        free = list(self.free_ids) + list(self.cached_free)
        assert len(free) == len(set(free)), "a block is free twice"
        assert all(self.ref_counts[b] == 0 for b in free), "a free block has a reference"
        assert all(c >= 0 for c in self.ref_counts), "a negative ref count"
        assert sum(1 for c in self.ref_counts if c == 0) == len(free), "a block with no reference is not free"
        assert all(self.block_keys[b] is not None for b in self.cached_free), "an LRU block without a key"
        assert all(self.block_keys[b] is None for b in self.free_ids), "a plain free block with a key"
        for key, block_id in self.key_to_block.items():
            assert self.block_keys[block_id] == key, "the key index and the blocks disagree"
