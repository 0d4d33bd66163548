"""Overlap (worker/engine/overlap.py) on against off: the same tokens, text, finish reasons and logprobs for a
workload that hits every event that must break the overlap or that the overlap must survive: preemption,
seats reused by waiting requests, sequences that stop at a point the scheduler cannot foresee, guided rows,
penalties, min_tokens, n > 1 forks (seeded top-p), logprobs, and an abort while a step is in flight."""

from __future__ import annotations

import re

import pytest

from tests.support.hf_reference import hf_greedy, load_hf
from worker import Engine, SamplingParams

PROMPTS = [
    "The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,",
    "List three colours:", "1, 2, 3, 4,", "Translate to French: good morning", "The quick brown fox",
    "Q: What is 12 times 12?\nA:",
]


@pytest.fixture(scope="module")
def model_dir(serve_model_dir):
    return serve_model_dir  # the session's tiny Llama (conftest)


def make_engine(model_dir: str, overlap: bool, **options) -> Engine:
    options = dict(device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=6,
                   block_size=8, max_model_len=128, cpu_kernels=False) | options
    return Engine(model_dir, overlap=overlap, **options)


def workload(stop_ids: dict[int, int]) -> list[SamplingParams]:
    """Per prompt: greedy mostly, with a stop id taken from the run without overlap (an end the scheduler
    cannot foresee), and rows that break the overlap or exercise the device-side draw."""
    params = []
    for i in range(len(PROMPTS)):
        p = dict(max_tokens=5 + (i * 5) % 11, temperature=0.0)
        if i in stop_ids:
            p["stop_token_ids"] = [stop_ids[i]]
        params.append(p)
    params[1] |= dict(temperature=0.9, top_p=0.9, seed=7, n=3)  # forks; top-p resolved on the device
    params[3] |= dict(repetition_penalty=1.3, presence_penalty=0.5)
    params[5] |= dict(min_tokens=5)
    params[6] |= dict(regex="[0-9]{2,6}", max_tokens=6)  # a guided row
    params[7] |= dict(logprobs=3, temperature=1.0, top_k=20, seed=5, n=2)
    return [SamplingParams(**p) for p in params]


def run(engine: Engine, params: list[SamplingParams]) -> dict:
    carried = []
    execute = engine.runner.execute

    def observed(step, *args, **kwargs):
        carried.append(step.carry_rows is not None)
        return execute(step, *args, **kwargs)

    engine.runner.execute = observed
    try:
        outs = engine.generate(PROMPTS, params)
    finally:
        engine.runner.execute = execute
    engine.block_manager.check_invariants([])
    assert engine.block_manager.num_free == engine.block_manager.num_blocks
    # logprobs rounded: a batch of another size changes their last float bits (the rows of a step differ with
    # overlap: a sequence that ends for sure is left out, one that ends on a token runs one row too many)
    got = {o.request_id.split("-")[-1]: [(c.token_ids, c.text, c.finish_reason, _rounded(c.logprobs))
                                         for c in o.choices] for o in outs}
    return got | {"carried": sum(carried)}


def _rounded(logprobs: list[dict[int, float]] | None) -> list[dict[int, float]] | None:
    return None if logprobs is None else [{t: round(v, 4) for t, v in row.items()} for row in logprobs]


@pytest.mark.slow
def test_overlap_on_gives_the_tokens_of_overlap_off(model_dir):
    off = make_engine(model_dir, overlap=False)
    assert off.overlap is None
    greedy = [0, 2, 4]
    first = off.generate([PROMPTS[i] for i in greedy], SamplingParams(max_tokens=6, temperature=0.0))
    # a stop id from the middle of some greedy outputs: those requests end where only the token tells
    stop_ids = {i: out.token_ids[3] for i, out in zip(greedy, first, strict=True) if out.token_ids[3] not in
                out.token_ids[:3]}
    assert len(stop_ids) >= 2
    params = workload(stop_ids)
    expected = run(off, params)
    preempted_off = off.scheduler.num_preemptions

    on = make_engine(model_dir, overlap=True)
    on.guided._lltokenizer = off.guided._lltokenizer  # the tokenizer table, built once (seconds)
    got = run(on, params)
    assert on.scheduler.num_preemptions > 0 and preempted_off > 0, "the workload should preempt"
    assert {k: v for k, v in got.items() if k != "carried"} == {k: v for k, v in expected.items() if k != "carried"}
    assert expected["carried"] == 0
    assert got["carried"] > 5, "steps without a breaking event should take their inputs from the step in flight"
    assert on.overlap.breaks > 0, "preemption / guided / penalty rows should have broken the overlap"
    for i, choices in got.items():
        if i.isdigit() and int(i) in stop_ids:
            assert choices[0][2] == "stop" and choices[0][0][-1] == stop_ids[int(i)]


def test_abort_while_a_step_is_in_flight(model_dir):
    params = SamplingParams(max_tokens=20, temperature=0.0)
    off = make_engine(model_dir, overlap=False, num_kv_blocks=64)
    alone = off.generate([PROMPTS[0]], params)[0].token_ids
    on = make_engine(model_dir, overlap=True, num_kv_blocks=64, static_decode=True)  # padded decode steps too
    on.add_request("keep", PROMPTS[0], params)
    on.add_request("drop", PROMPTS[1], params)
    for _ in range(4):
        on.step()
    assert on.overlap.inflight is not None
    out = on.abort("drop")  # its blocks are freed now, while the device may still write its next slot
    assert out is not None and out.finish_reason == "abort"
    on.add_request("new", PROMPTS[2], params)  # takes the freed seat and blocks
    outputs = {}
    while on.has_unfinished_requests():
        outputs |= {o.request_id: o for o in on.step()}
    assert outputs["keep"].token_ids == alone
    assert outputs["new"].token_ids == off.generate([PROMPTS[2]], params)[0].token_ids
    on.block_manager.check_invariants([])
    assert on.block_manager.num_free == on.block_manager.num_blocks


@pytest.fixture(scope="module")
def hf_tiny(model_dir):
    return load_hf(model_dir)


_lltokenizer: dict[str, object] = {}  # llguidance's table of the tokenizer, built once for the module (seconds)


@pytest.mark.parametrize("overlap", [False, True], ids=["overlap-off", "overlap-on"])
def test_greedy_equals_hf_with_overlap_on_and_off(model_dir, hf_tiny, overlap):
    """Greedy fp32 token for token against HF generate, through preemption (6 KV blocks of 8 tokens), seats
    reused (10 requests, 4 seats), n > 1 forks, a stop token id, a stop string, a guided row beside them."""
    engine = make_engine(model_dir, overlap)
    if "table" in _lltokenizer:
        engine.guided._lltokenizer = _lltokenizer["table"]
    max_tokens = [12, 7, 16, 5, 14, 9, 11, 6]
    refs = [hf_greedy(hf_tiny, engine.tokenize(p), m) for p, m in zip(PROMPTS, max_tokens, strict=True)]
    prompts = list(PROMPTS)
    params = [SamplingParams(max_tokens=m, temperature=0.0) for m in max_tokens]
    stop_id = next(t for t in refs[2][4:] if t not in refs[2][:4])  # ends row 2 where only its token tells
    params[2] = SamplingParams(max_tokens=max_tokens[2], temperature=0.0, stop_token_ids=[stop_id])
    params[4] = SamplingParams(max_tokens=max_tokens[4], temperature=0.0, n=3)  # forks of one prompt
    full = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0.0))[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    prompts.append(PROMPTS[0])  # row 8: row 0 again, cut at a stop string from the middle of its text
    params.append(SamplingParams(max_tokens=12, temperature=0.0, stop=stop))
    prompts.append(PROMPTS[1])  # row 9: a guided row (its grammar masks; its neighbours must not notice)
    params.append(SamplingParams(max_tokens=6, temperature=0.0, regex="[0-9]{2,6}"))
    outs = engine.generate(prompts, params)
    _lltokenizer.setdefault("table", engine.guided._lltokenizer)

    for i in (0, 1, 3, 5, 6, 7):
        assert outs[i].token_ids == refs[i], f"prompt {i} differs from HF"
    cut = refs[2].index(stop_id) + 1
    assert outs[2].token_ids == refs[2][:cut] and outs[2].finish_reason == "stop"
    assert [c.token_ids for c in outs[4].choices] == [refs[4]] * 3
    assert outs[8].text == full[: full.find(stop)] and outs[8].finish_reason == "stop"
    assert outs[8].token_ids == refs[0][: len(outs[8].token_ids)]
    assert re.fullmatch("[0-9]{2,6}", outs[9].text), outs[9].text
    assert engine.scheduler.num_preemptions > 0, "the workload should preempt"
    if overlap:
        assert engine.overlap.breaks > 0, "preemption and the guided row should have broken the overlap"
    engine.block_manager.check_invariants([])
    assert engine.block_manager.num_free == engine.block_manager.num_blocks
