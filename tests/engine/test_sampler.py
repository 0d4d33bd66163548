"""The sampler on its own: no host sync in its device work, exact top-k / top-p / min-p support against a
sort-based reference, seeded rows independent of the batch, greedy = argmax."""

from __future__ import annotations

import time
from contextlib import contextmanager

import pytest
import torch

from worker.engine.backends.reference import ReferenceBackend
from worker.engine.sampler import Sampler
from worker.engine.sampling_filters import (
    TOP_P_CANDIDATES,
    FilterParams,
    apply_filters,
    log_or_neg_inf,
    resolve_top_p,
)
from worker.engine.sampling_params import SamplingParams
from worker.engine.sequence import Sequence

VOCAB = 3001  # odd, not a power of two, wider than the top-p candidate set


def make_seq(params: SamplingParams, i: int = 0, prompt: list[int] | None = None) -> Sequence:
    generator = None
    if params.seed is not None:
        generator = torch.Generator().manual_seed(params.seed)
    return Sequence(f"r{i}", prompt or [1, 2, 3], params, time.time(), None, generator=generator)  # type: ignore[arg-type]


def make_sampler(vocab: int = VOCAB) -> Sampler:
    return Sampler(vocab, torch.device("cpu"), eos_token_ids=[0], backend=ReferenceBackend())


BATCHES = {
    "greedy": [SamplingParams(temperature=0.0)] * 3,
    "temperature": [SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, seed=5)],
    "top_k": [SamplingParams(temperature=1.0, top_k=7), SamplingParams(temperature=1.0, top_k=40, seed=2)],
    "top_p": [SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=0.8, top_p=0.5, seed=3)],
    "mixed": [SamplingParams(temperature=0.0, top_p=0.3), SamplingParams(temperature=1.0, top_k=5, top_p=0.8),
              SamplingParams(temperature=1.0, min_p=0.2, seed=9), SamplingParams(temperature=0.5)],
}


@contextmanager
def host_syncs_forbidden(monkeypatch):
    """Every way a tensor's value reaches Python raises while the block runs."""
    def forbid(name):
        def raiser(*args, **kwargs):
            raise AssertionError(f"host sync: Tensor.{name} inside the sampler's device work")
        return raiser

    with monkeypatch.context() as m:
        for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu"):
            m.setattr(torch.Tensor, name, forbid(name))
        yield


@pytest.mark.parametrize("kind", sorted(BATCHES))
def test_no_host_sync_in_the_device_work(kind, monkeypatch):
    sampler = make_sampler()
    seqs = [make_seq(p, i) for i, p in enumerate(BATCHES[kind])]
    logits = torch.randn(len(seqs), VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    with host_syncs_forbidden(monkeypatch):
        step = sampler(logits, seqs)
    tokens, _ = step.result()
    assert len(tokens) == len(seqs) and all(0 <= t < VOCAB for t in tokens)


def test_the_sync_guard_catches_a_sync(monkeypatch):
    with host_syncs_forbidden(monkeypatch), pytest.raises(AssertionError, match="host sync"):
        bool(torch.ones(2).all())


def test_penalties_min_tokens_and_logprobs_stay_off_the_host_too(monkeypatch):
    sampler = make_sampler()
    params = [SamplingParams(temperature=0.9, repetition_penalty=1.3, presence_penalty=0.5, logprobs=3,
                             min_tokens=4, stop_token_ids=[17]),
              SamplingParams(temperature=0.0, frequency_penalty=0.4, logprobs=1)]
    seqs = [make_seq(p, i, prompt=[5, 6, 7, 5]) for i, p in enumerate(params)]
    seqs[1].token_ids.append(9)
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(4))
    with host_syncs_forbidden(monkeypatch):
        step = sampler(logits, seqs)
    tokens, rows = step.result()
    assert tokens[0] not in (17, 0)  # min_tokens banned the stop id and EOS
    assert [len(r[0]) for r in rows] == [3, 1] and all(isinstance(r[2], float) for r in rows)


def reference_support(logits: torch.Tensor, k: int, p: float, min_p: float) -> torch.Tensor:
    """The kept tokens of one row by sorting it whole: top-k, then top-p on what is left, then min-p."""
    order = logits.argsort(descending=True)
    vals = logits[order]
    keep = torch.ones_like(vals, dtype=torch.bool)
    if k:
        keep &= vals >= vals[min(k, len(vals)) - 1]
    probs = torch.where(keep, vals, torch.tensor(float("-inf"))).softmax(-1)
    if p < 1.0:
        keep &= (probs.cumsum(-1) - probs) < p
    if min_p > 0:
        probs = torch.where(keep, vals, torch.tensor(float("-inf"))).softmax(-1)
        keep &= probs >= min_p * probs.max()
    mask = torch.zeros_like(keep)
    mask[order] = keep
    return mask


@pytest.mark.parametrize("vocab", [7, 97, 1000, 2053, 5003])
@pytest.mark.parametrize("scale", [0.3, 3.0])
def test_filters_keep_exactly_the_reference_support(vocab, scale):
    gen = torch.Generator().manual_seed(vocab * 10 + int(scale * 10))
    cases = [(0, 1.0, 0.0), (1, 1.0, 0.0), (5, 1.0, 0.0), (vocab, 1.0, 0.0), (0, 0.9, 0.0), (0, 0.5, 0.0),
             (0, 1e-6, 0.0), (20, 0.8, 0.0), (0, 1.0, 0.1), (13, 0.95, 0.05), (0, 0.999, 0.0)]
    logits = torch.randn(len(cases), vocab, generator=gen) * scale
    fp = FilterParams(
        top_k=torch.tensor([k if k else vocab for k, _, _ in cases]),
        top_p=torch.tensor([p for _, p, _ in cases])[:, None],
        log_min_p=torch.tensor([log_or_neg_inf(m) for _, _, m in cases])[:, None],
        max_k=max((k for k, _, _ in cases if 0 < k < vocab), default=0), any_top_p=True, any_min_p=True)
    out = apply_filters(logits, fp)
    for i, (k, p, m) in enumerate(cases):
        want = reference_support(logits[i], k, p, m)
        if out.unresolved is not None and bool(out.unresolved[i]):
            # only a nucleus wider than the candidates waits for the full sort
            assert p < 1.0 and int(want.sum()) > TOP_P_CANDIDATES, f"case {cases[i]} left unresolved"
            got = resolve_top_p(out.after_top_k, fp, torch.tensor([i]))[0] > float("-inf")
        else:
            got = out.logits[i] > float("-inf")
        assert torch.equal(got, want), f"vocab {vocab} case {cases[i]}: {int(got.sum())} kept, want {int(want.sum())}"


def test_a_wide_nucleus_is_cut_after_the_sync_with_the_reference_support():
    vocab = 20_000
    sampler = make_sampler(vocab)
    seqs = [make_seq(SamplingParams(temperature=1.0, top_p=0.9, seed=s), s) for s in range(3)]
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0)) * 0.1  # flat: ~18k in the nucleus
    step = sampler(logits, seqs)
    assert (step.tokens < 0).all(), "a flat row cannot be cut from the candidates"
    tokens, _ = step.result()
    for i, t in enumerate(tokens):
        assert reference_support(logits[i], 0, 0.9, 0.0)[t]
    again = make_sampler(vocab)([logits[1:2]][0], [make_seq(SamplingParams(temperature=1.0, top_p=0.9, seed=1))])
    assert again.result()[0] == [tokens[1]]


def draws(sampler: Sampler, logits: torch.Tensor, params: list[SamplingParams], n: int) -> list[list[int]]:
    seqs = [make_seq(p, i) for i, p in enumerate(params)]
    return [sampler(logits, seqs).result()[0] for _ in range(n)]


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.9, seed=11),
                                    SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=12),
                                    SamplingParams(temperature=1.2, min_p=0.05, seed=13)])
def test_seeded_rows_are_independent_of_the_batch(params):
    gen = torch.Generator().manual_seed(21)
    row = torch.randn(1, VOCAB, generator=gen)
    alone = [d[0] for d in draws(make_sampler(), row, [params], 8)]
    others = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0, top_k=500, seed=3), SamplingParams(temperature=0.6, top_p=0.2)]
    for crowd in (others[:1], others, others[::-1] + others):
        batch = torch.cat([torch.randn(len(crowd), VOCAB, generator=gen), row])
        inside = [d[-1] for d in draws(make_sampler(), batch, crowd + [params], 8)]
        assert inside == alone
    assert len(set(alone)) > 1, "eight seeded draws all alike: the noise does not advance"


def test_greedy_is_argmax_in_any_batch():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, VOCAB, generator=gen)
    params = [SamplingParams(temperature=0.0, top_k=3, top_p=0.1) if i % 2 else SamplingParams(temperature=1.0)
              for i in range(6)]
    tokens = draws(make_sampler(), logits, params, 1)[0]
    assert tokens[1::2] == logits[1::2].argmax(-1).tolist()
    all_greedy = draws(make_sampler(), logits, [SamplingParams(temperature=0.0)] * 6, 1)[0]
    assert all_greedy == logits.argmax(-1).tolist()


def test_sampled_tokens_follow_the_distribution():
    # 4 tokens at probabilities 0.5/0.3/0.15/0.05, top_p=0.9 drops the last: frequencies over 4000 draws
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()[None].repeat(4000, 1)
    seqs = [make_seq(SamplingParams(temperature=1.0, top_p=0.9), i) for i in range(4000)]
    tokens = torch.tensor(make_sampler(4)(logits, seqs).result()[0])
    freq = torch.bincount(tokens, minlength=4).float() / 4000
    assert freq[3] == 0
    assert torch.allclose(freq[:3], torch.tensor([0.5, 0.3, 0.15]) / 0.95, atol=0.03), freq
