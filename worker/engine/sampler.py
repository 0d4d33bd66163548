"""Batched sampling: one row of logits per sequence that produces a token this step.

Penalties and filters are tensor ops over the whole batch. Randomness is per row: a seeded request draws
its noise from its own generator, so its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from worker.engine.backends import Backend
from worker.engine.sequence import Sequence


class RequestError(Exception):
    """A step failed on one request's own row (its parameters, its tokens): `request_id` names it, so the
    serve loop fails that job alone and the rest of the batch steps on. Raised before any sequence changed."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(message)
        self.request_id = request_id


@contextmanager
def blame(seq: Sequence, what: str) -> Iterator[None]:
    """Pin an exception inside one row's work on that row's request."""
    try:
        yield
    except RequestError:
        raise
    except Exception as err:
        raise RequestError(seq.request_id, f"{what} failed for request {seq.request_id!r}: "
                                           f"{type(err).__name__}: {err}") from err


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, eos_token_ids: list[int], backend: Backend) -> None:
        self.argmax = backend.argmax
        self.vocab_size = vocab_size
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.unseeded = torch.Generator(device=device)
        self.unseeded.manual_seed(torch.seed() & 0xFFFF_FFFF)

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list | None]:
        logits = logits.float()
        self._ban_early_stops(logits, seqs)
        if any(s.params.has_penalties for s in seqs):
            logits = self._apply_penalties(logits, seqs)
        logprobs = self._top_logprobs(logits, seqs)
        greedy = torch.tensor([s.params.greedy for s in seqs], device=logits.device)
        if bool(greedy.all()):
            return self.argmax(logits).tolist(), logprobs
        temps = torch.tensor([s.params.temperature or 1.0 for s in seqs], device=logits.device)
        scaled = self._filter(logits / temps[:, None], seqs)
        probs = torch.softmax(scaled, dim=-1)
        # Exponential race: argmax(p / E) with E ~ Exp(1) is a draw from p, and E can come from any generator.
        noise = torch.empty_like(probs)
        unseeded_rows = []
        for i, seq in enumerate(seqs):
            if seq.generator is not None:
                with blame(seq, "seeded sampling"):
                    noise[i].exponential_(generator=seq.generator)
            else:
                unseeded_rows.append(i)
        if unseeded_rows:
            rows = torch.tensor(unseeded_rows, device=logits.device)
            noise[rows] = torch.empty(len(rows), probs.shape[1], device=logits.device).exponential_(
                generator=self.unseeded
            )
        sampled = (probs / noise).argmax(dim=-1)
        tokens = torch.where(greedy, self.argmax(logits), sampled)
        return tokens.tolist(), logprobs

    def _ban_early_stops(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        for i, seq in enumerate(seqs):
            if seq.num_output_tokens < seq.params.min_tokens:
                banned = list(seq.params.stop_ids)
                if not seq.params.ignore_eos:
                    banned += self.eos_token_ids
                if banned:
                    with blame(seq, f"min_tokens (banning stop tokens {banned[:5]})"):
                        logits[i, banned] = float("-inf")

    def _apply_penalties(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        batch, vocab = logits.shape
        output_counts = torch.zeros(batch, vocab, device=logits.device)
        seen = torch.zeros(batch, vocab, dtype=torch.bool, device=logits.device)
        for i, seq in enumerate(seqs):
            with blame(seq, "penalties"):
                out = torch.tensor(seq.output_token_ids, dtype=torch.long, device=logits.device)
                if out.numel():
                    output_counts[i].index_add_(0, out, torch.ones(out.numel(), device=logits.device))
                seen[i, torch.tensor(seq.token_ids, dtype=torch.long, device=logits.device)] = True
        rep = torch.tensor([s.params.repetition_penalty for s in seqs], device=logits.device)[:, None]
        pres = torch.tensor([s.params.presence_penalty for s in seqs], device=logits.device)[:, None]
        freq = torch.tensor([s.params.frequency_penalty for s in seqs], device=logits.device)[:, None]
        # repetition penalty as in CTRL / Hugging Face: over prompt and output, shrinking the logit either way
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalised, logits)
        # presence / frequency as in the OpenAI API: over the generated tokens only
        return logits - freq * output_counts - pres * (output_counts > 0).float()

    def _filter(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        top_k = [s.params.top_k for s in seqs]
        top_p = [s.params.top_p for s in seqs]
        min_p = [s.params.min_p for s in seqs]
        if any(k > 0 for k in top_k):
            k = torch.tensor([k if k > 0 else self.vocab_size for k in top_k], device=logits.device)
            k = k.clamp(max=logits.shape[1])
            sorted_desc = logits.sort(dim=-1, descending=True).values
            kth = sorted_desc.gather(1, (k - 1)[:, None])
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if any(p < 1.0 for p in top_p):
            p = torch.tensor(top_p, device=logits.device)[:, None]
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
            # drop a token when the mass before it already reaches p (the top token always stays)
            drop_sorted = (cum - sorted_logits.softmax(dim=-1)) >= p
            drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
            logits = logits.masked_fill(drop, float("-inf"))
        if any(m > 0 for m in min_p):
            m = torch.tensor(min_p, device=logits.device)[:, None]
            probs = logits.softmax(dim=-1)
            threshold = m * probs.max(dim=-1, keepdim=True).values
            logits = logits.masked_fill(probs < threshold, float("-inf"))
        return logits

    def _top_logprobs(self, logits: torch.Tensor, seqs: list[Sequence]) -> list | None:
        wanted = [s.params.logprobs for s in seqs]
        if all(w is None for w in wanted):
            return None
        logp = torch.log_softmax(logits, dim=-1)
        n = max(w or 0 for w in wanted)
        top_vals, top_ids = logp.topk(max(n, 1), dim=-1)
        rows = []
        for i, w in enumerate(wanted):
            if w is None:
                rows.append(None)
                continue
            rows.append((logp[i], top_ids[i, :w].tolist(), top_vals[i, :w].tolist()))
        return rows
