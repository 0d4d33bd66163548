"""Constraint costs (#22, attacks 5-7): the submit check refuses what the engine would choke on, with the same
limits (protocol/constraints.py LIMITS), and a grammar whose mask costs too much fails alone in the engine."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from producer.openai_batch import CHAT, body_request
from protocol.constraints import LIMITS, ConstraintLimits, grammar_for, regex_repeat
from protocol.errors import InvalidJob
from protocol.models import ErrorCode
from worker.engine import loader
from worker.engine.errors import InvalidRequest
from worker.engine.guided import GrammarTooCostly, GuidedDecoding
from worker.engine.sampling_params import SamplingParams
from worker.engine.sequence import Sequence

VOCAB, EOS = 49152, 2


@pytest.fixture(scope="module")
def tokenizer():
    return loader.load_tokenizer(loader.resolve("smollm2-135m"))


@pytest.fixture(scope="module")
def lltokenizer(tokenizer):
    import llguidance.hf

    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=VOCAB, eos_token=[EOS])


def guided_for(tokenizer, lltokenizer, **kwargs) -> GuidedDecoding:
    guided = GuidedDecoding(tokenizer, VOCAB, [EOS], torch.device("cpu"), **kwargs)
    guided._lltokenizer = lltokenizer  # built once for the module (seconds each)
    return guided


def chat(**body):
    return body_request(CHAT, {"model": "m", "messages": [{"role": "user", "content": "hi"}]} | body)


@pytest.mark.parametrize(("body", "limit"), [
    ({"regex": "a{100000}"}, "max_repeat = 1000"),             # attack 6
    ({"regex": "(a{40}){40}"}, "max_repeat = 1000"),           # nested counts multiply
    ({"regex": "x" * 9000}, "max_regex_bytes"),
    ({"choice": [f"w{i}" for i in range(60_000)]}, "max_choice_count = 1000"),  # attacks 5 and 7
    ({"choice": [f"w{i}" for i in range(LIMITS.max_choice_count + 1)]}, "max_choice_count"),
    ({"choice": ["y" * 40_000, "z" * 40_000]}, "max_choice_bytes"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {
        "type": "string", "maxLength": 100_000}}}}, "max_repeat"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {
        "type": "string", "pattern": "b{5000}"}}}}, "max_repeat"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {
        "type": "object", "properties": {f"p{i}": {"type": "string", "description": "d" * 100}
                                         for i in range(1000)}}}}}, "max_schema_bytes"),
])
def test_submit_refuses_a_costly_constraint_naming_the_limit(body, limit):
    start = time.perf_counter()
    with pytest.raises(InvalidJob) as err:
        chat(**body)
    assert limit in str(err.value)
    assert time.perf_counter() - start < 2.0  # refused by counting, before any grammar is built


def test_schema_nesting_depth_is_capped():
    schema: dict = {"type": "string"}
    for _ in range(40):
        schema = {"type": "array", "items": schema}
    with pytest.raises(InvalidJob, match="max_schema_depth"):
        chat(response_format={"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}})


def test_regex_repeat_reads_classes_escapes_and_groups():
    assert regex_repeat(r"a\{999999}") == 1
    assert regex_repeat(r"[{]{5}x") == 5
    assert regex_repeat(r"((a{10}b){10}){11}") == 1100
    assert regex_repeat(r"(a{3}|b{50})+c{,7}") == 50
    assert regex_repeat(r"[a-z]+@[a-z]{2,10}") == 10


def test_the_largest_accepted_choice_runs_in_the_engine(tokenizer, lltokenizer):
    """Attack 7: max_choice_count choices sharing a prefix passed submit and failed in the engine (2,000 did:
    an Earley row holds n + 1 items). At the limit the engine's matcher walks them to the end."""
    import llguidance

    words = [f"item {i}" for i in range(LIMITS.max_choice_count)]
    chat(choice=words)  # accepted at submit
    matcher = llguidance.LLMatcher(lltokenizer, grammar_for(None, None, words), log_level=0,
                                   limits=LIMITS.parser_limits())
    for token in tokenizer.encode("item 517"):
        np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
        assert not matcher.is_error(), matcher.get_error()
        assert matcher.consume_token(token)
    assert matcher.is_accepting()


def _ready(guided: GuidedDecoding, seq: Sequence) -> None:
    deadline = time.monotonic() + 60
    while not guided.is_ready(seq):
        assert time.monotonic() < deadline
        guided.wait(0.1)


def test_a_mask_over_budget_fails_that_request_alone(tokenizer, lltokenizer):
    """Attack 6 in the engine (as if submit had let it in): a{100000} costs 25-200 ms of CPU per mask. Its
    first mask already goes over the budget, so it fails at compile, code grammar_too_costly; with the budget
    set below every mask, the step raises GrammarTooCostly naming that request before any sequence changed."""
    costly = SamplingParams.model_construct(regex="a{100000}")  # skips the submit check on purpose
    guided = guided_for(tokenizer, lltokenizer)
    seq = Sequence("attack", [1, 2, 3], costly, time.time(), detokenizer=None)
    guided.add(seq)
    deadline = time.monotonic() + 60
    while not (failed := guided.take_failed()):
        assert not guided.is_ready(seq) and time.monotonic() < deadline
        guided.wait(0.1)
    assert failed[0][0] is seq and isinstance(failed[0][1], InvalidRequest)
    assert failed[0][1].code == ErrorCode.grammar_too_costly and "mask_budget_ms" in str(failed[0][1])

    strict = guided_for(tokenizer, lltokenizer, limits=ConstraintLimits(mask_budget_ms=1e9))
    victim = Sequence("victim", [1, 2, 3], SamplingParams(regex="[a-z]{1,40}"), time.time(), detokenizer=None)
    plain = Sequence("plain", [1, 2, 3], SamplingParams(), time.time(), detokenizer=None)
    for s in (victim, plain):
        strict.add(s)
    _ready(strict, victim)
    logits = torch.randn(2, VOCAB)
    strict.apply(logits, [plain, victim])  # within budget: masked
    strict.limits = ConstraintLimits(mask_budget_ms=0.0)
    before = logits.clone()
    with pytest.raises(GrammarTooCostly) as err:
        strict.apply(logits, [plain, victim])
    assert err.value.request_id == "victim" and err.value.code == ErrorCode.grammar_too_costly
    assert isinstance(err.value, InvalidRequest), "the constraint's cost is the client's to fix"
    assert torch.equal(logits, before)
