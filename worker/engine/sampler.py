"""Batched sampling: one row of logits per sequence that produces a token this step.

Penalties and filters are tensor ops over the whole batch, queued without a host sync; the step's ids reach
the host in one non-blocking copy that `SampledStep.result()` waits for. Randomness is per row: a seeded
request draws its noise from its own generator, so its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from worker.engine.backends import Backend
from worker.engine.errors import EngineError, fault
from worker.engine.sampling_filters import Filtered, FilterParams, apply_filters, log_or_neg_inf, resolve_top_p
from worker.engine.sequence import Sequence


@contextmanager
def blame(seq: Sequence, what: str) -> Iterator[None]:
    """Pin an exception inside one row's work on that row's request."""
    try:
        yield
    except EngineError:
        raise
    except Exception as err:
        raise fault(err, f"{what} failed for request {seq.request_id!r}", seq.request_id) from err


class Sampler:
    """Samples one token per row. `__call__` queues the device work and one non-blocking copy of the ids to
    the host (pinned memory on CUDA) and returns a SampledStep; its `result()` waits for that copy once.

    Which path a row takes (greedy, filters, seeded) is decided from its SamplingParams, known on the host:
    no Python branch reads a device value before `result()`.
    """

    def __init__(self, vocab_size: int, device: torch.device, eos_token_ids: list[int], backend: Backend) -> None:
        self.argmax = backend.argmax
        self.vocab_size = vocab_size
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.unseeded = torch.Generator(device=device)
        self.unseeded.manual_seed(torch.seed() & 0xFFFF_FFFF)

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence], resolve_on_device: bool = False) -> SampledStep:
        """resolve_on_device (overlap): rows top-p left unresolved are cut here, so the device ids are final
        before the next step reads them (a sync on the forward thread, only on steps with top-p rows)."""
        logits = logits.float()
        self._ban_early_stops(logits, seqs)
        if any(s.params.has_penalties for s in seqs):
            logits = self._apply_penalties(logits, seqs)
        greedy = [s.params.greedy for s in seqs]
        fp = filtered = noise = None
        if all(greedy):
            tokens = self.argmax(logits)
        else:
            fp = self._filter_params(seqs)
            temps = self._to_device([s.params.temperature or 1.0 for s in seqs], torch.float32)
            filtered = apply_filters(logits / temps[:, None], fp)
            noise = self._noise(logits.shape, seqs, greedy)
            # Exponential race: argmax(p / E), E ~ Exp(1), is a draw from p; in log space, logit - log E.
            tokens = (filtered.logits - noise.log()).argmax(dim=-1)
            if any(greedy):
                tokens = torch.where(self._to_device(greedy, torch.bool), self.argmax(logits), tokens)
            if filtered.unresolved is not None and resolve_on_device:
                late = filtered.unresolved.nonzero().flatten()
                if late.numel():
                    cut = resolve_top_p(filtered.after_top_k, fp, late)
                    tokens[late] = (cut - noise[late].log()).argmax(dim=-1)
                filtered = None
            elif filtered.unresolved is not None:
                tokens = tokens.masked_fill(filtered.unresolved, -1)  # the host cuts these rows in result()
        logprobs = self._top_logprobs(logits, tokens, seqs)
        host_tokens = self._to_host(tokens)
        ready = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        return SampledStep(host_tokens, ready, logprobs, filtered, fp, noise, tokens)

    def _noise(self, shape: torch.Size, seqs: list[Sequence], greedy: list[bool]) -> torch.Tensor:
        noise = torch.empty(shape, device=self.device).exponential_(generator=self.unseeded)
        for i, seq in enumerate(seqs):
            # a seeded row's noise over the whole vocabulary comes from its own generator, so neither the
            # batch nor the filter's candidate set changes its draw
            if seq.generator is not None and not greedy[i]:
                with blame(seq, "seeded sampling"):
                    noise[i].exponential_(generator=seq.generator)
        # Exp(1) can return 0 (log -> -inf, and -inf - -inf is NaN): the smallest normal float instead
        return noise.clamp_(min=torch.finfo(noise.dtype).tiny)

    def _filter_params(self, seqs: list[Sequence]) -> FilterParams:
        vocab = self.vocab_size
        # a greedy row filters nothing: its token is the argmax whatever its top-k / top-p say
        ps = [1.0 if s.params.greedy else s.params.top_p for s in seqs]
        ks = [vocab if s.params.greedy or s.params.top_k == 0 else min(s.params.top_k, vocab) for s in seqs]
        ms = [float("-inf") if s.params.greedy else log_or_neg_inf(s.params.min_p) for s in seqs]
        return FilterParams(
            top_k=self._to_device(ks, torch.int64),
            top_p=self._to_device(ps, torch.float32)[:, None],
            log_min_p=self._to_device(ms, torch.float32)[:, None],
            max_k=max((k for k in ks if k < vocab), default=0),
            any_top_p=any(p < 1.0 for p in ps),
            any_min_p=any(m > float("-inf") for m in ms),
        )

    def _ban_early_stops(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        rows: list[int] = []
        cols: list[int] = []
        for i, seq in enumerate(seqs):
            if seq.num_output_tokens < seq.params.min_tokens:
                banned = list(seq.params.stop_ids)
                if not seq.params.ignore_eos:
                    banned += self.eos_token_ids
                with blame(seq, f"min_tokens (banning stop tokens {banned[:5]})"):
                    # checked here: an id past the vocabulary would be a device-side assert on CUDA
                    bad = [t for t in banned if not 0 <= t < logits.shape[1]]
                    if bad:
                        raise IndexError(f"stop token id {bad[0]} is out of the vocabulary [0, {logits.shape[1]})")
                rows += [i] * len(banned)
                cols += banned
        if rows:
            logits[self._to_device(rows, torch.int64), self._to_device(cols, torch.int64)] = float("-inf")

    def _apply_penalties(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        batch, vocab = logits.shape
        out_rows: list[int] = []
        out_ids: list[int] = []
        seen_rows: list[int] = []
        seen_ids: list[int] = []
        for i, seq in enumerate(seqs):
            with blame(seq, "penalties"):
                if seq.token_ids and not (0 <= min(seq.token_ids) and max(seq.token_ids) < vocab):
                    raise IndexError(f"a token id of the sequence is out of the vocabulary [0, {vocab})")
            out = seq.output_token_ids
            out_rows += [i] * len(out)
            out_ids += out
            seen_rows += [i] * seq.num_tokens
            seen_ids += seq.token_ids
        output_counts = torch.zeros(batch, vocab, device=logits.device)
        if out_ids:
            flat = self._to_device(out_rows, torch.int64) * vocab + self._to_device(out_ids, torch.int64)
            output_counts.view(-1).index_add_(0, flat, torch.ones(len(out_ids), device=logits.device))
        seen = torch.zeros(batch, vocab, dtype=torch.bool, device=logits.device)
        seen[self._to_device(seen_rows, torch.int64), self._to_device(seen_ids, torch.int64)] = True
        rep = self._to_device([s.params.repetition_penalty for s in seqs], torch.float32)[:, None]
        pres = self._to_device([s.params.presence_penalty for s in seqs], torch.float32)[:, None]
        freq = self._to_device([s.params.frequency_penalty for s in seqs], torch.float32)[:, None]
        # repetition penalty as in CTRL / Hugging Face: over prompt and output, shrinking the logit either way
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalised, logits)
        # presence / frequency as in the OpenAI API: over the generated tokens only
        return logits - freq * output_counts - pres * (output_counts > 0).float()

    def _top_logprobs(self, logits: torch.Tensor, tokens: torch.Tensor, seqs: list[Sequence]) -> _Logprobs | None:
        wanted = [s.params.logprobs for s in seqs]
        if all(w is None for w in wanted):
            return None
        logp = torch.log_softmax(logits, dim=-1)
        n = max(w or 0 for w in wanted)
        top_vals, top_ids = logp.topk(max(n, 1), dim=-1)
        chosen = logp.gather(1, tokens.clamp(min=0)[:, None]).squeeze(1)
        return _Logprobs(wanted, logp, self._to_host(top_ids), self._to_host(top_vals), self._to_host(chosen))

    def _to_device(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        """A small host list on the device without a blocking copy (pinned staging on CUDA)."""
        if self.device.type == "cpu":
            return torch.tensor(values, dtype=dtype)
        return torch.tensor(values, dtype=dtype).pin_memory().to(self.device, non_blocking=True)

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        """Start t's copy to pinned host memory; it is complete once SampledStep.result() has waited."""
        if self.device.type == "cpu":
            return t
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        return host


@dataclass
class _Logprobs:
    wanted: list[int | None]  # per row: how many top logprobs (None: none asked)
    logp: torch.Tensor  # [rows, vocab] on the device, for rows whose token is known only after the sync
    top_ids: torch.Tensor  # host copies, complete after the step's sync
    top_vals: torch.Tensor
    chosen: torch.Tensor  # the sampled token's logprob per row


@dataclass
class SampledStep:
    """One step's sampled ids on their way to the host. `result()` waits once (an event on CUDA) and
    returns (token ids, logprob rows); a logprob row is (top ids, top logprobs, the token's logprob)."""

    tokens: torch.Tensor  # [rows] int64 on the host (pinned on CUDA); -1 marks a row result() must cut
    ready: torch.cuda.Event | None
    logprobs: _Logprobs | None
    filtered: Filtered | None
    filter_params: FilterParams | None
    noise: torch.Tensor | None
    device_tokens: torch.Tensor | None = None  # [rows] int64 on the device: the next step's carried inputs

    def result(self) -> tuple[list[int], list | None]:
        if self.ready is not None:
            self.ready.synchronize()
        tokens = self.tokens.tolist()
        late = [i for i, t in enumerate(tokens) if t < 0]
        chosen = self.logprobs.chosen.tolist() if self.logprobs is not None else None
        if late:
            self._cut_late(late, tokens, chosen)
        if self.logprobs is None:
            return tokens, None
        top_ids, top_vals = self.logprobs.top_ids.tolist(), self.logprobs.top_vals.tolist()
        rows = [None if w is None else (top_ids[i][:w], top_vals[i][:w], chosen[i])
                for i, w in enumerate(self.logprobs.wanted)]
        return tokens, rows

    def _cut_late(self, late: list[int], tokens: list[int], chosen: list[float] | None) -> None:
        """Rows whose top-p nucleus was wider than the candidate set: cut with a full sort, then draw with
        the same noise (a second sync, only on such steps)."""
        assert self.filtered is not None and self.filtered.after_top_k is not None
        assert self.filter_params is not None and self.noise is not None
        rows = torch.tensor(late, device=self.noise.device)
        cut = resolve_top_p(self.filtered.after_top_k, self.filter_params, rows)
        drawn = (cut - self.noise[rows].log()).argmax(dim=-1)
        for i, token in zip(late, drawn.tolist(), strict=True):
            tokens[i] = token
        if chosen is not None:
            assert self.logprobs is not None
            for i, lp in zip(late, self.logprobs.logp[rows, drawn].tolist(), strict=True):
                chosen[i] = lp
