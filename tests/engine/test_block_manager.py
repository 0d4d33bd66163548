"""The block manager alone: prefix-cache keys, reuse, the LRU, eviction and shared blocks (no model)."""

from __future__ import annotations

from worker.engine.block_manager import BlockManager, block_hash
from worker.engine.sampling_params import SamplingParams
from worker.engine.sequence import Sequence


def make_seq(ids: list[int], rid: str = "r") -> Sequence:
    return Sequence(rid, ids, SamplingParams(), 0.0, detokenizer=None)


def run_prompt(bm: BlockManager, seq: Sequence) -> list[int]:
    """Admit seq and 'compute' its whole prompt, as a scheduler step would."""
    hits = bm.match_prefix(seq)
    n = seq.num_tokens - len(hits) * bm.block_size
    assert bm.can_admit(seq, hits, n)
    bm.admit(seq, hits)
    bm.allocate(seq, n)
    seq.num_computed_tokens += n
    bm.commit(seq)
    return hits


def test_keys_depend_on_the_whole_prefix():
    assert block_hash(None, [1, 2]) == block_hash(None, [1, 2])
    assert block_hash(None, [1, 2]) != block_hash(None, [2, 1])
    assert block_hash(block_hash(None, [1]), [2]) != block_hash(block_hash(None, [3]), [2])


def test_shared_prefix_reused_and_refcounted():
    bm = BlockManager(8, 4)
    a = make_seq(list(range(10)), "a")  # 2 full blocks + 2 tokens
    assert run_prompt(bm, a) == []
    b = make_seq(list(range(8)) + [99, 98, 97], "b")
    hits = run_prompt(bm, b)
    assert hits == a.block_table[:2] and b.num_cached_tokens == 8
    assert bm.ref_counts[hits[0]] == 2
    bm.check_invariants([a, b])
    bm.free(a)  # a sharer leaving never frees the other's blocks
    assert bm.ref_counts[hits[0]] == 1 and hits[0] not in bm.cached_free
    bm.check_invariants([b])
    bm.free(b)
    bm.check_invariants([])
    assert bm.num_free == 8 and bm.num_cached >= 2


def test_last_token_always_computed():
    bm = BlockManager(8, 4)
    a = make_seq(list(range(8)), "a")
    run_prompt(bm, a)
    bm.free(a)
    b = make_seq(list(range(8)), "b")  # the same 2 full blocks: only the first may be reused
    assert len(bm.match_prefix(b)) == 1


def test_lru_keeps_cached_blocks_until_needed_then_evicts():
    bm = BlockManager(4, 4)
    a = make_seq(list(range(9)), "a")  # 3 blocks
    run_prompt(bm, a)
    bm.free(a)
    assert bm.num_free == 4 and len(bm.cached_free) == 2
    big = make_seq([500 + i for i in range(13)], "big")  # 4 blocks: takes the plain free ones, then evicts
    run_prompt(bm, big)
    assert bm.stats.evictions == 2 and bm.num_cached == 3
    bm.check_invariants([big])
    bm.free(big)
    c = make_seq(list(range(9)), "c")
    assert bm.match_prefix(c) == []  # a's prefix was evicted
    bm.check_invariants([])


def test_cache_off_reuses_nothing():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    a = make_seq(list(range(9)), "a")
    run_prompt(bm, a)
    bm.free(a)
    assert bm.match_prefix(make_seq(list(range(9)))) == [] and bm.num_cached == 0
    bm.check_invariants([])


def test_prefix_groups_are_the_shared_physical_blocks():
    bm = BlockManager(32, 4)
    system = list(range(100, 112))  # 3 full blocks
    a = make_seq(system + [1, 2, 3], "a")
    run_prompt(bm, a)
    b = make_seq(system + [7, 7], "b")  # takes a's 3 blocks
    c = make_seq(system[:8] + [9, 9, 9, 9, 9], "c")  # takes 2 of them
    d = make_seq([5] * 9, "d")  # shares nothing
    for seq in (b, c, d):
        run_prompt(bm, seq)
    assert b.block_table[:3] == a.block_table[:3] and c.block_table[:2] == a.block_table[:2]
    groups = bm.prefix_groups([d, a, b, c])
    assert [(g.members, g.num_blocks) for g in groups] == [([1, 2, 3], 2)]
    assert [(g.members, g.num_blocks) for g in bm.prefix_groups([a, b])] == [([0, 1], 3)]
    assert bm.prefix_groups([a, d]) == [] and bm.prefix_groups([]) == []  # a alone: no group
    e = make_seq([5] * 9, "e")  # d's first 2 blocks: a second group
    run_prompt(bm, e)
    groups = bm.prefix_groups([a, d, b, e])
    assert [(g.members, g.num_blocks) for g in groups] == [([0, 2], 3), ([1, 3], 2)]
    bm.free(b)  # a leaving sharer takes its table with it
    assert [(g.members, g.num_blocks) for g in bm.prefix_groups([a, c])] == [([0, 1], 2)]


def test_prefix_groups_none_without_the_prefix_cache():
    bm = BlockManager(16, 4, enable_prefix_caching=False)
    a, b = make_seq(list(range(9)), "a"), make_seq(list(range(9)), "b")
    run_prompt(bm, a)
    run_prompt(bm, b)
    assert bm.prefix_groups([a, b]) == []
