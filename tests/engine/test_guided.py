"""GuidedDecoding on its own with the SmolLM2 tokenizer (no model weights): the bitmask touches only the
constrained rows, EOS is allowed only where the grammar accepts, reset replays the output, bad grammars fail."""

from __future__ import annotations

import time

import pytest
import torch

from worker.engine import loader
from worker.engine.guided import GrammarError, GuidedDecoding, forbidden_numpy, forbidden_torch, word_bits
from worker.engine.sampling_params import SamplingParams
from worker.engine.sequence import Sequence

VOCAB, EOS = 49152, 2


@pytest.fixture(scope="module")
def tokenizer():
    return loader.load_tokenizer(loader.resolve("smollm2-135m"))


def make_seq(rid: str, params: SamplingParams) -> Sequence:
    return Sequence(rid, [1, 2, 3], params, time.time(), detokenizer=None)


def ready(guided: GuidedDecoding, seq: Sequence) -> None:
    deadline = time.monotonic() + 60
    while not guided.is_ready(seq):
        assert not guided.take_failed() and time.monotonic() < deadline
        guided.wait(0.1)


def allowed(row: torch.Tensor) -> set[int]:
    return set(torch.isfinite(row).nonzero().flatten().tolist())


def test_mask_only_constrained_rows_and_eos_where_grammar_accepts(tokenizer):
    guided = GuidedDecoding(tokenizer, VOCAB, [EOS], torch.device("cpu"))
    choice = make_seq("c", SamplingParams(choice=["yes", "no"]))
    plain = make_seq("p", SamplingParams())
    for s in (plain, choice):
        guided.add(s)
    ready(guided, choice)
    assert guided.is_ready(plain)

    logits = torch.randn(2, VOCAB)
    before = logits.clone()
    guided.apply(logits, [plain, choice])
    assert torch.equal(logits[0], before[0])  # unconstrained row untouched
    first = allowed(logits[1])
    yes, no = tokenizer.encode("yes"), tokenizer.encode("no")
    assert {yes[0], no[0]} <= first and EOS not in first and len(first) < 10
    assert torch.equal(logits[1][list(first)], before[1][list(first)])

    for t in yes:
        choice.token_ids.append(t)
        guided.advance(choice, t)
    logits = torch.randn(1, VOCAB)
    guided.apply(logits, [choice])  # every row constrained: the in-place path
    assert allowed(logits[0]) == {EOS}

    # preemption: the matcher is rebuilt from the sequence's own output tokens
    guided.reset(choice)
    logits = torch.randn(1, VOCAB)
    guided.apply(logits, [choice])
    assert allowed(logits[0]) == {EOS}
    guided.remove(choice)
    assert not guided.matchers


def test_regex_mask_and_grammar_cache(tokenizer):
    guided = GuidedDecoding(tokenizer, VOCAB, [EOS], torch.device("cpu"))
    a, b = make_seq("a", SamplingParams(regex="[0-9]{2}")), make_seq("b", SamplingParams(regex="[0-9]{2}"))
    guided.add(a)
    guided.add(b)
    assert len(guided._compiled) == 1  # one compile for the same grammar
    ready(guided, a)
    ready(guided, b)
    logits = torch.zeros(1, VOCAB)
    guided.apply(logits, [a])
    texts = {tokenizer.decode([t]) for t in allowed(logits[0])}
    assert texts and all(t.isascii() and t.isdigit() and len(t) <= 2 for t in texts)


def test_grammar_that_fails_to_compile_leaves_through_take_failed(tokenizer):
    guided = GuidedDecoding(tokenizer, VOCAB, [EOS], torch.device("cpu"))
    bad = make_seq("bad", SamplingParams.model_construct(regex="("))  # past the producer's check
    guided.add(bad)
    deadline = time.monotonic() + 60
    failed = []
    while not failed and time.monotonic() < deadline:
        assert not guided.is_ready(bad)
        guided.wait(0.1)
        failed = guided.take_failed()
    assert failed and failed[0][0] is bad and "cannot be compiled" in str(failed[0][1])
    assert isinstance(failed[0][1], GrammarError) and failed[0][1].code == "invalid_request"
    with pytest.raises(GrammarError, match="cannot be compiled"):
        guided.add(make_seq("again", SamplingParams.model_construct(regex="(")))


def test_both_bitmask_unpackings_agree_with_the_layout():
    mask = torch.randint(-(2**31), 2**31 - 1, (3, 5), dtype=torch.int32)
    mask[0, 0], mask[1, 1] = 0b101, -(2**31)  # tokens 0 and 2; token 32 + 31
    expect = torch.tensor([[not (int(w) >> j) & 1 for w in row for j in range(32)] for row in mask.tolist()])
    numpy_way, torch_way = forbidden_numpy(mask, 150), forbidden_torch(mask, word_bits(mask.device), 150)
    assert torch.equal(numpy_way, expect[:, :150]) and torch.equal(torch_way, expect[:, :150])
    assert (~numpy_way[0, :32]).nonzero().flatten().tolist() == [0, 2]
    assert (~numpy_way[1, 32:64]).nonzero().flatten().tolist() == [31]
