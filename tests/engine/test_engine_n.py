"""n > 1 on the real default model: one prompt, n choices forked over its cached blocks."""

from __future__ import annotations

import pytest

from worker import Engine, SamplingParams

PROMPT = "Write one sentence about the sea. " * 12  # several full blocks to fork over


@pytest.fixture(scope="module")
def engine():
    return Engine("smollm2-135m", device="cpu", dtype="float32", max_num_seqs=8, max_num_batched_tokens=256)


def test_n4_seeded_equals_four_separately_seeded_jobs(engine):
    params = dict(max_tokens=12, temperature=0.9, top_p=0.95, seed=1234)
    hits_before = engine.block_manager.stats.hit_tokens
    (out,) = engine.generate([PROMPT], SamplingParams(n=4, **params))
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    # choices 1..3 took the prompt's full blocks from choice 0
    assert engine.block_manager.stats.hit_tokens - hits_before >= 3 * (len(out.prompt_token_ids) // 16) * 16
    assert out.token_ids == out.choices[0].token_ids and out.text == out.choices[0].text
    separate = engine.generate([PROMPT] * 4, [SamplingParams(**(params | {"seed": 1234 + i})) for i in range(4)])
    assert [c.token_ids for c in out.choices] == [s.token_ids for s in separate]
    assert len({tuple(c.token_ids) for c in out.choices}) > 1, "the choices should differ"


def test_n_greedy_choices_agree_and_cache_off_still_works(engine):
    (out,) = engine.generate([PROMPT], SamplingParams(n=3, max_tokens=6, temperature=0.0))
    assert len(out.choices) == 3 and all(c.token_ids == out.token_ids for c in out.choices)
    off = Engine("smollm2-135m", device="cpu", dtype="float32", enable_prefix_caching=False, max_num_seqs=8)
    (out_off,) = off.generate([PROMPT], SamplingParams(n=3, max_tokens=6, temperature=0.0))
    assert [c.token_ids for c in out_off.choices] == [c.token_ids for c in out.choices]
    assert off.block_manager.stats.hit_tokens == 0 and off.block_manager.num_free == off.block_manager.num_blocks


def test_abort_mid_run_frees_every_choice(engine):
    engine.add_request("many", PROMPT, SamplingParams(n=4, max_tokens=40, temperature=0.8, seed=3))
    for _ in range(4):
        engine.step()
    assert len([s for s in engine.choices["many"] if s.block_table]) >= 2  # siblings share blocks now
    out = engine.abort("many")
    assert out is not None and len(out.choices) == 4
    assert all(c.finish_reason == "abort" for c in out.choices)
    assert not engine.has_unfinished_requests()
    engine.block_manager.check_invariants([])
    assert engine.block_manager.num_free == engine.block_manager.num_blocks


def test_n_out_of_range_is_refused():
    with pytest.raises(ValueError, match="n"):
        SamplingParams.from_dict({"n": 0})
    with pytest.raises(ValueError, match="n"):
        SamplingParams.from_dict({"n": 10_000})
