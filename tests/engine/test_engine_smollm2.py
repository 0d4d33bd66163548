"""The engine on the real default model, token for token against Hugging Face `generate` (greedy, fp32)."""

from __future__ import annotations

import pytest

from worker import Engine, SamplingParams
from worker.engine.errors import EngineFault, InvalidRequest

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "List three colours:",
    "1, 2, 3, 4,",
    "Translate to French: good morning",
    "The quick brown fox",
    "Q: What is 12 times 12?\nA:",
    "import numpy as np\n",
    "Dear Sir or Madam,",
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "What is the boiling point of water?"}],
    "In 1969, the first",
    "SELECT * FROM",
]
MAX_TOKENS = [5, 31, 17, 9, 40, 12, 3, 25, 14, 8, 33, 20, 1, 16]


@pytest.fixture(scope="module")
def hf_model(smollm2_reference):
    # straight from the source directory through transformers: independent of the engine's converted checkpoint;
    # its answers shared with the other SmolLM2 modules (tests/engine/conftest.py)
    return smollm2_reference


@pytest.fixture(scope="module")
def engine():
    return Engine("smollm2-135m", device="cpu", dtype="float32", max_num_seqs=8, max_num_batched_tokens=256)


@pytest.fixture(autouse=True)
def blocks_all_free(request):
    yield
    for name in ("engine", "small_engine", "chunk_engine"):
        if name in request.fixturenames:
            eng = request.getfixturevalue(name)
            assert not eng.has_unfinished_requests()
            assert eng.block_manager.num_free == eng.block_manager.num_blocks, "KV blocks leaked"


def reference(hf_model, engine, prompt, max_tokens: int) -> list[int]:
    return hf_model.greedy(engine.tokenize(prompt), max_tokens)


def assert_equals_hf(outputs: dict[str, list[int]], hf_model, engine, prompts, max_tokens) -> None:
    for i, (prompt, m) in enumerate(zip(prompts, max_tokens, strict=True)):
        assert outputs[f"r{i}"] == reference(hf_model, engine, prompt, m), f"prompt {i} {prompt!r} differs"


def run_staggered(engine: Engine, prompts, max_tokens, arrive_every: int = 2) -> dict[str, list[int]]:
    """Add a request every few steps, so most arrive while others are mid-decode."""
    pending = [(f"r{i}", p, m) for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True))]
    outputs: dict[str, list[int]] = {}
    admitted_while_running = 0
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % arrive_every == 0:
            rid, prompt, m = pending.pop(0)
            if engine.scheduler.running:
                admitted_while_running += 1
            engine.add_request(rid, prompt, SamplingParams(max_tokens=m, temperature=0.0))
        for out in engine.step():
            outputs[out.request_id] = out.token_ids
        step += 1
    assert admitted_while_running >= len(prompts) // 2, "the staggered arrival did not overlap decoding"
    return outputs


def test_staggered_arrival_equals_hf(engine, hf_model):
    assert engine.backend.name == "cpu-cpp", "the CPU serving path should run the C++ kernels"
    outputs = run_staggered(engine, PROMPTS, MAX_TOKENS)
    assert_equals_hf(outputs, hf_model, engine, PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def small_engine():
    # 10 blocks x 16 = 160 tokens for 6 sequences of ~40-60 tokens each: preemption is unavoidable
    return Engine("smollm2-135m", device="cpu", dtype="float32", num_kv_blocks=10, max_num_seqs=6)


def test_preemption_by_recompute_equals_hf(small_engine, hf_model):
    prompts, max_tokens = PROMPTS[:6], [30, 31, 30, 28, 40, 30]
    before = small_engine.scheduler.num_preemptions
    outputs = run_staggered(small_engine, prompts, max_tokens, arrive_every=1)
    assert small_engine.scheduler.num_preemptions > before, "the tiny KV cache did not force a preemption"
    assert_equals_hf(outputs, hf_model, small_engine, prompts, max_tokens)


@pytest.fixture(scope="module")
def chunk_engine():
    return Engine("smollm2-135m", device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=48)


def test_long_prompt_is_chunk_prefilled_alongside_decodes(chunk_engine, hf_model):
    long_prompt = " ".join(f"Item {i} is a {['red', 'blue', 'green'][i % 3]} box." for i in range(40))
    ids = chunk_engine.tokenize(long_prompt)
    assert len(ids) > 3 * 48
    chunk_engine.add_request("short", PROMPTS[0], SamplingParams(max_tokens=30, temperature=0.0))
    chunk_engine.step()
    chunk_engine.add_request("long", long_prompt, SamplingParams(max_tokens=12, temperature=0.0))
    outputs: dict[str, list[int]] = {}
    shared_steps = 0
    while chunk_engine.has_unfinished_requests():
        batch_before = {s.request_id for s in chunk_engine.scheduler.running}
        long_seq = chunk_engine.requests.get("long")
        prefilling = long_seq is not None and 0 < long_seq.num_pending_tokens and long_seq.num_output_tokens == 0
        for out in chunk_engine.step():
            outputs[out.request_id] = out.token_ids
        if prefilling and "short" in batch_before and "short" in chunk_engine.deltas:
            shared_steps += 1
    assert shared_steps >= 3, "the long prompt was not prefilled in chunks alongside the short one's decode"
    assert outputs["long"] == reference(hf_model, chunk_engine, long_prompt, 12)
    assert outputs["short"] == reference(hf_model, chunk_engine, PROMPTS[0], 30)


def test_abort_frees_blocks_at_once(engine):
    engine.add_request("a", PROMPTS[2], SamplingParams(max_tokens=50, temperature=0.0))
    engine.add_request("b", PROMPTS[3], SamplingParams(max_tokens=50, temperature=0.0))
    for _ in range(3):
        engine.step()
    used = engine.block_manager.num_used
    assert used > 0
    out = engine.abort("a")
    assert out.finish_reason == "abort" and 0 < len(out.token_ids) <= 3
    assert engine.block_manager.num_used < used
    engine.abort("b")
    assert engine.block_manager.num_used == 0
    assert engine.abort("nope") is None


def test_seeded_sampling_is_independent_of_the_batch(engine):
    params = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    alone = engine.generate([PROMPTS[2]], params)[0].token_ids
    crowd_params = [SamplingParams(max_tokens=20, temperature=1.0, seed=s) for s in range(7)]
    crowded = engine.generate(PROMPTS[3:10] + [PROMPTS[2]], crowd_params + [params])
    assert crowded[-1].token_ids == alone
    other_seed = engine.generate([PROMPTS[2]], SamplingParams(max_tokens=20, temperature=0.9, seed=99))[0]
    assert other_seed.token_ids != alone


def test_stop_strings_end_and_trim_output(engine):
    free = engine.generate(["1, 2, 3, 4,"], SamplingParams(max_tokens=20, temperature=0.0))[0]
    assert " 7" in free.text
    out = engine.generate(["1, 2, 3, 4,"], SamplingParams(max_tokens=20, temperature=0.0, stop=[" 7", "zzz"]))[0]
    assert out.finish_reason == "stop"
    assert out.text == free.text[: free.text.index(" 7")]
    assert len(out.token_ids) < len(free.token_ids)


def test_stop_token_ids_min_tokens_and_logprobs(engine):
    free = engine.generate(["1, 2, 3, 4,"], SamplingParams(max_tokens=10, temperature=0.0))[0]
    stop_id = free.token_ids[3]
    out = engine.generate(["1, 2, 3, 4,"], SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[stop_id]))[0]
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[: free.token_ids.index(stop_id) + 1]
    chat = [{"role": "user", "content": "Hi!"}]
    short = engine.generate([chat], SamplingParams(max_tokens=60, temperature=0.0))[0]
    assert short.finish_reason == "stop" and short.token_ids[-1] in engine.eos_token_ids
    forced = engine.generate([chat], SamplingParams(max_tokens=60, min_tokens=len(short.token_ids) + 5,
                                                    temperature=0.0))[0]
    assert len(forced.token_ids) >= len(short.token_ids) + 5
    assert not set(forced.token_ids[: len(short.token_ids) + 4]) & set(engine.eos_token_ids)
    lp = engine.generate(["The quick brown fox"], SamplingParams(max_tokens=4, temperature=0.0, logprobs=3))[0]
    assert len(lp.logprobs) == 4
    for token, row in zip(lp.token_ids, lp.logprobs, strict=True):
        assert token in row and len(row) == 3  # greedy: the chosen token is the top one
        assert max(row, key=row.get) == token and all(v <= 0 for v in row.values())


def _step_texts(engine, requests: dict[str, tuple]) -> tuple[dict[str, str], dict[str, object]]:
    """Run requests to the end: (each one's step deltas joined, its RequestOutput)."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    joined = dict.fromkeys(requests, "")
    outputs = {}
    while len(outputs) < len(requests):
        for out in engine.step():
            outputs[out.request_id] = out
        for rid, delta in engine.deltas.items():
            if rid in joined:
                joined[rid] += delta.text
    return joined, outputs


def test_step_deltas_join_to_the_result_text(engine):
    """One detokenizer for streaming and the result: the deltas join to the final text exactly, whatever the
    request's skip_special_tokens, and a stop string is never handed out before the text is cut at it."""
    chat = [{"role": "user", "content": "Say hi in French and in Japanese."}]
    greedy = dict(max_tokens=40, temperature=0.0, ignore_eos=True)  # runs past <|im_end|>: special tokens
    requests = {
        "skip": (chat, SamplingParams(**greedy)),
        "keep": (chat, SamplingParams(**greedy, skip_special_tokens=False)),
        "stop": ("1, 2, 3, 4,", SamplingParams(max_tokens=20, temperature=0.0, stop=[" 7", "zzz"])),
    }
    joined, outputs = _step_texts(engine, requests)
    for rid, out in outputs.items():
        assert joined[rid] == out.text, rid
    keep, skip = outputs["keep"], outputs["skip"]
    assert keep.token_ids == skip.token_ids
    assert keep.text == engine.tokenizer.decode(keep.token_ids, skip_special_tokens=False)
    assert skip.text == engine.tokenizer.decode(skip.token_ids, skip_special_tokens=True)
    assert "<|im_end|>" in keep.text and "<|im_end|>" not in skip.text
    assert outputs["stop"].finish_reason == "stop" and " 7" not in joined["stop"]


def test_ignore_eos_runs_to_max_tokens(engine):
    chat = [{"role": "user", "content": "Hi!"}]
    out = engine.generate([chat], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 40


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ("", {}, "empty"),
        ([], {}, "empty"),
        ("hi", {"max_tokenz": 5}, "unknown sampling parameter"),
        ("hi", {"max_tokens": 0}, "max_tokens"),
        ("hi", {"max_tokens": -3}, "max_tokens"),
        ("hi", {"temperature": -1.0}, "temperature"),
        ("hi", {"top_p": 0.0}, "top_p"),
        ("word " * 9000, {"max_tokens": 4}, "context"),
        ("hi", {"max_tokens": 9000}, "exceeds the model context"),
        ([10**9], {}, "vocabulary"),
        ([{"content": "no role"}], {}, "role"),
    ],
)
def test_bad_input_is_refused_with_a_clear_error(engine, prompt, params, message):
    with pytest.raises(InvalidRequest, match=message):  # the client's to fix (the serve loop: invalid_request)
        engine.add_request("bad", prompt, params)
    assert "bad" not in engine.requests


def test_request_that_can_never_fit_the_cache_is_refused(small_engine):
    with pytest.raises(InvalidRequest, match="never fit the KV cache"):
        small_engine.add_request("huge", "hello", SamplingParams(max_tokens=400))


def test_duplicate_request_id_is_refused(engine):
    engine.add_request("dup", "hello", SamplingParams(max_tokens=2))
    with pytest.raises(EngineFault, match="already") as err:
        engine.add_request("dup", "hello", SamplingParams(max_tokens=2))
    assert not isinstance(err.value, InvalidRequest), "a caller's bug, not the request's: a worker_error"
    assert err.value.code == "worker_error"
    engine.abort("dup")


def test_penalties_and_filters_change_what_is_sampled(engine):
    prompt = "1, 2, 3, 4,"
    greedy = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0))[0].token_ids
    # top_k=1 keeps only the argmax: sampling at any temperature is then greedy
    top1 = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=1.5, top_k=1, seed=3))[0]
    assert top1.token_ids == greedy
    # a tiny top_p keeps only the top token too
    nucleus = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=1.0, top_p=1e-6, seed=3))[0]
    assert nucleus.token_ids == greedy
    # min_p = 1 keeps only tokens as likely as the best one
    assert engine.generate([prompt], SamplingParams(max_tokens=24, temperature=1.0, min_p=1.0, seed=5))[0] \
        .token_ids == greedy
    # counting "," repeats: penalties must push the counting pattern away
    comma = engine.tokenizer.encode(",")[0]
    repeats = greedy.count(comma)
    for field in ({"repetition_penalty": 1.8}, {"frequency_penalty": 2.0}, {"presence_penalty": 2.0}):
        out = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, **field))[0].token_ids
        assert out != greedy and out.count(comma) < repeats, field


def test_unseeded_sampling_varies(engine):
    params = SamplingParams(max_tokens=16, temperature=1.2)
    outs = engine.generate(["Once upon a time"] * 4, [params] * 4)
    assert len({tuple(o.token_ids) for o in outs}) > 1
