"""Prefix caching on the real default model, token for token against Hugging Face `generate` (greedy, fp32):
prompts sharing a long system prompt, cold and warm, under eviction and preemption, and a shared prefix that
ends mid-block."""

from __future__ import annotations

import pytest

from worker import Engine, SamplingParams

SYSTEM = (
    "You are a careful assistant for a small hardware shop. Answer in one short sentence. "
    + " ".join(f"Rule {i}: item {i} costs {3 * i + 1} euros and ships in {i % 5 + 1} days." for i in range(24))
    + "\nQuestion: "
)
OTHER_SYSTEM = "You are a poet. " + " ".join(f"Line {i} rhymes with {i * 7} and {i * 11}." for i in range(30))
QUESTIONS = [
    "How much is item 3?", "When does item 7 ship?", "What is rule 12?", "Which item is cheapest?",
    "Is item 20 expensive?", "How many rules are there?", "What costs 10 euros?", "Name a fast item.",
    "What is item 1?", "Does item 9 ship fast?", "Tell me about rule 0.", "Which rule mentions 40 euros?",
    "What is the shop?", "Can I buy item 23?", "What about item 15?", "Summarise rule 5.",
]


@pytest.fixture(scope="module")
def hf_model(smollm2_reference):
    return smollm2_reference  # HF generate, each answer computed once a session (tests/engine/conftest.py)


def reference(hf_model, ids: list[int], max_tokens: int) -> list[int]:
    return hf_model.greedy(ids, max_tokens)


def run_staggered(engine: Engine, prompts: list[list[int]], max_tokens: list[int], every: int = 2):
    pending = list(enumerate(zip(prompts, max_tokens, strict=True)))
    outputs: dict[int, list[int]] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % every == 0:
            i, (ids, m) = pending.pop(0)
            engine.add_request(f"p{i}", ids, SamplingParams(max_tokens=m, temperature=0.0))
        for out in engine.step():
            outputs[int(out.request_id[1:])] = out.token_ids
        engine.block_manager.check_invariants(list(engine.scheduler.running))
        step += 1
    return [outputs[i] for i in range(len(prompts))]


def assert_equals_hf(hf_model, prompts, max_tokens, outputs) -> None:
    for i, (ids, m, got) in enumerate(zip(prompts, max_tokens, outputs, strict=True)):
        assert got == reference(hf_model, ids, m), f"prompt {i} differs from HF"


@pytest.fixture(scope="module")
def engine():
    return Engine("smollm2-135m", device="cpu", dtype="float32", max_num_seqs=16, max_num_batched_tokens=512)


def test_shared_system_prompt_cold_then_warm_equals_hf(engine, hf_model):
    # eight questions, not sixteen: each one's HF reference is a ~370-token prefill, and eight arrivals behind the
    # shared prefix already take the cold path (the first computes it, the rest reuse it) and the warm one
    prompts = [engine.tokenize(SYSTEM + q) for q in QUESTIONS[:8]]
    shared = len(engine.tokenize(SYSTEM)) - 2  # the question's first token may merge with the prefix's last
    assert shared >= 300
    max_tokens = [4 + (i * 5) % 13 for i in range(len(prompts))]
    stats = engine.block_manager.stats
    cold = run_staggered(engine, prompts, max_tokens)
    cold_hits = stats.hit_tokens
    # cold: the first prompt computes the prefix, each later one reuses its full blocks
    assert cold_hits >= (len(prompts) - 1) * (shared // 16) * 16
    assert_equals_hf(hf_model, prompts, max_tokens, cold)
    warm = run_staggered(engine, prompts, max_tokens, every=1)
    assert stats.hit_tokens - cold_hits >= len(prompts) * (shared // 16) * 16
    assert warm == cold


@pytest.fixture(scope="module")
def tight_engine():
    # 48 blocks x 16 tokens: two ~350-token system prompts (22 blocks each) cannot both stay cached next to
    # the sequences' own blocks, so cached blocks are evicted and running sequences preempted
    return Engine("smollm2-135m", device="cpu", dtype="float32", num_kv_blocks=48, max_num_seqs=8,
                  max_num_batched_tokens=512)


def test_eviction_and_preemption_keep_hf_parity(tight_engine, hf_model):
    eng = tight_engine
    # eight prompts, not sixteen: the 48 blocks are already short (two system prompts take 44 of them), and each
    # prompt's Hugging Face reference is the test's largest cost
    prompts = [eng.tokenize((SYSTEM if i % 4 < 2 else OTHER_SYSTEM) + q) for i, q in enumerate(QUESTIONS[:8])]
    max_tokens = [24 + (i * 7) % 17 for i in range(len(prompts))]
    preemptions, evictions = eng.scheduler.num_preemptions, eng.block_manager.stats.evictions
    outputs = run_staggered(eng, prompts, max_tokens, every=1)
    assert eng.scheduler.num_preemptions > preemptions, "no preemption happened"
    assert eng.block_manager.stats.evictions > evictions, "no cached block was evicted"
    assert eng.block_manager.stats.hit_tokens > 0
    assert_equals_hf(hf_model, prompts, max_tokens, outputs)


def test_prefix_ending_mid_block_and_whole_prompt_hits(engine, hf_model):
    base = engine.tokenize(SYSTEM + QUESTIONS[0])
    bs = engine.config.block_size
    cut = 20 * bs + 7  # the shared part ends 7 tokens into block 20
    tails = [engine.tokenize(" Also, what ships in 2 days?"), engine.tokenize(" And the total for items 1-4?")]
    prompts = [base[:cut] + tails[0], base[:cut] + tails[1],
               base[: 21 * bs],  # a whole-block prompt: its last block is recomputed (last-token rule)
               base[: 21 * bs + 1]]  # one token past cached blocks: a single-token query mid-sequence
    max_tokens = [9, 9, 7, 7]
    engine.generate([base[:cut]], SamplingParams(max_tokens=1, temperature=0.0))  # caches blocks 0..19 only
    outs = []
    for ids, m in zip(prompts, max_tokens, strict=True):
        outs.append(engine.generate([ids], SamplingParams(max_tokens=m, temperature=0.0))[0])
    cached = [o.num_cached_tokens for o in outs]
    assert cached[0] == cached[1] == 20 * bs  # only full blocks of the shared part are reused
    assert cached[2] == 20 * bs and cached[3] == 21 * bs
    assert_equals_hf(hf_model, prompts, max_tokens, [o.token_ids for o in outs])
