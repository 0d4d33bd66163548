"""Cascade decode attention in the engine (worker/engine/cascade.py): the cost rule and the modes on real
block tables, and the engine token for token equal to Hugging Face `generate` with cascading forced on
(every decode row through the cascade path): SmolLM2 behind a shared system prompt on the C++ kernels (the
fused decode layers and the per-layer path of mixed steps), a tiny Llama on the PyTorch references with
padded decode steps."""

from __future__ import annotations

import pytest

from testbed.tiny_models import make_tiny_model
from tests.engine.test_block_manager import make_seq, run_prompt
from tests.engine.test_prefix_cache_smollm2 import QUESTIONS, SYSTEM, assert_equals_hf
from tests.engine.test_prefix_cache_smollm2 import run_staggered as run_prompts
from tests.support.hf_reference import hf_greedy, load_hf
from worker import Engine
from worker.engine.block_manager import BlockManager
from worker.engine.cascade import MERGE_COST_TOKENS, CascadePlanner, pays


def test_the_rule_weighs_tokens_saved_against_merging():
    assert not pays(1, 10_000)  # a row alone saves nothing
    assert not pays(2, 2 * MERGE_COST_TOKENS) and pays(2, 2 * MERGE_COST_TOKENS + 1)
    assert pays(64, 48) and not pays(64, 32)


def sharing(bm: BlockManager, prefix_blocks: int, tails: list[int]):
    system = list(range(1000, 1000 + prefix_blocks * bm.block_size))
    seqs = [make_seq(system + [7] * n + [i], f"s{i}") for i, n in enumerate(tails)]
    for seq in seqs:
        run_prompt(bm, seq)
    return seqs


def lens_of(seqs):
    return [s.num_tokens + 1 for s in seqs]  # the step's new token included


def test_auto_cascades_what_pays_and_counts_the_reads():
    bm = BlockManager(256, 16)
    group = sharing(bm, 8, [3, 5, 9])  # 128 shared tokens, 3 rows: pays
    alone = [make_seq([5] * 40, "alone")]
    run_prompt(bm, alone[0])
    planner = CascadePlanner(bm, "auto")
    rows = [alone[0], *group]
    layout = planner.layout(rows, lens_of(rows), 6, "cpu")  # two padding rows after them
    assert layout is not None and layout.group_rows.tolist() == [1, 2, 3] and layout.prefix_lens.tolist() == [128]
    assert layout.suffix_starts.tolist() == [0, 128, 128, 128, 0, 0]
    s = planner.stats
    assert (s.steps, s.groups, s.grouped_rows) == (1, 1, 3)
    assert s.kv_tokens_plain == sum(lens_of(rows)) and s.kv_tokens_plain - s.kv_tokens_read == 2 * 128
    assert planner.layout(alone, lens_of(alone), 1, "cpu") is None and planner.stats.steps == 1


def test_auto_leaves_a_short_prefix_and_off_never_cascades():
    bm = BlockManager(64, 16)
    rows = sharing(bm, 2, [1, 4])  # a pair behind 32 tokens: merging costs more than it saves
    assert CascadePlanner(bm, "auto").layout(rows, lens_of(rows), 2, "cpu") is None
    assert CascadePlanner(bm, "off").layout(rows, lens_of(rows), 2, "cpu") is None
    assert CascadePlanner(bm, "on").layout(rows, lens_of(rows), 2, "cpu").prefix_lens.tolist() == [32]


def test_on_puts_every_other_row_in_a_group_of_one():
    bm = BlockManager(64, 16)
    rows = sharing(bm, 2, [1, 4])
    long_alone, short_alone = make_seq([3] * 40, "long"), make_seq([4] * 9, "short")
    run_prompt(bm, long_alone)
    run_prompt(bm, short_alone)
    batch = [long_alone, *rows, short_alone]
    layout = CascadePlanner(bm, "on").layout(batch, lens_of(batch), 4, "cpu")
    # the pair, then the long row alone over its 2 full blocks; the short one has no full block: plain
    assert layout.group_starts.tolist() == [0, 2, 3] and layout.group_rows.tolist() == [1, 2, 0]
    assert layout.prefix_lens.tolist() == [32, 32] and layout.suffix_starts.tolist() == [32, 32, 32, 0]
    with pytest.raises(ValueError, match="cascade_attention"):
        CascadePlanner(bm, "always")


@pytest.fixture(scope="module")
def hf_smollm2(smollm2_reference):
    return smollm2_reference  # HF generate, each answer computed once a session (tests/engine/conftest.py)


def test_smollm2_shared_system_prompt_with_cascade_forced_on(hf_smollm2):
    engine = Engine("smollm2-135m", device="cpu", dtype="float32", max_num_seqs=8, max_num_batched_tokens=512,
                    cascade_attention="on")
    prompts = [engine.tokenize(SYSTEM + q) for q in QUESTIONS[:8]]
    # test_prefix_cache_smollm2's first eight requests exactly: the session computes their HF answers once
    max_tokens = [4 + (i * 5) % 13 for i in range(len(prompts))]
    outputs = run_prompts(engine, prompts, max_tokens, every=1)
    stats = engine.stats()
    assert stats.cascade_grouped_rows > stats.cascade_groups, "no group of rows sharing the prefix cascaded"
    assert stats.decode_kv_tokens_read < stats.decode_kv_tokens_plain / 2, stats
    assert_equals_hf(hf_smollm2, prompts, max_tokens, outputs)


def test_tiny_reference_backend_padded_with_cascade_forced_on(tmp_path):
    directory = make_tiny_model(str(tmp_path / "llama"), "llama")
    engine = Engine(directory, device="cpu", dtype="float32", max_num_seqs=6, max_num_batched_tokens=32,
                    static_decode=True, cpu_kernels=False, cascade_attention="on")
    assert engine.backend.name == "torch-reference"
    shared = [(i * 37) % 500 + 3 for i in range(45)]  # 2 full blocks and a part of one
    prompts = [shared + [11 + i] * (1 + i % 3) for i in range(5)] + [[9, 8, 7]]
    max_tokens = [12, 20, 7, 15, 18, 10]
    outputs = run_prompts(engine, prompts, max_tokens, every=1)
    assert engine.stats().cascade_grouped_rows > engine.stats().cascade_groups
    hf = load_hf(directory)
    for i, (ids, m) in enumerate(zip(prompts, max_tokens, strict=True)):
        assert outputs[i] == hf_greedy(hf, ids, m), f"prompt {i} differs"
