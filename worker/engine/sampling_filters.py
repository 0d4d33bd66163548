"""Top-k, top-p and min-p over a batch of logits as tensor ops: no host sync, and no sort of the whole
[rows, vocab] when a candidate set serves.

The candidates are each row's `width` largest logits (`topk`, sorted): width is the largest k in the batch,
and at least TOP_P_CANDIDATES when a row asks for top-p. A row whose nucleus reaches past its candidates
(a flat distribution) cannot be cut from them; it is marked unresolved, and `resolve_top_p` cuts it with a
full sort once the host has seen the mark. Semantics are those of a sort over the whole row: top-k keeps every
logit >= the k-th largest (ties at the k-th included); top-p, applied after top-k, drops a token once the
probability mass before it reaches p (the top token always stays); min-p, last, drops tokens below
min_p × the top probability.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

TOP_P_CANDIDATES = 1024
# topk over more than this share of the vocabulary costs about what one sort does
SORT_ABOVE_SHARE = 0.25
NEG_INF = float("-inf")


@dataclass
class FilterParams:
    """Per-row filter values on the device, and what the host knows of them (which filters any row uses)."""

    top_k: torch.Tensor  # [rows] int64, the vocabulary size where a row has no top-k
    top_p: torch.Tensor  # [rows, 1] float32
    log_min_p: torch.Tensor  # [rows, 1] float32, -inf where a row has no min-p
    max_k: int  # largest top-k in the batch (0: none)
    any_top_p: bool
    any_min_p: bool


@dataclass
class Filtered:
    logits: torch.Tensor  # [rows, vocab], dropped tokens at -inf
    unresolved: torch.Tensor | None  # [rows] bool: top-p not applied yet (nucleus wider than the candidates)
    after_top_k: torch.Tensor | None  # what resolve_top_p starts from


def candidates(logits: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's `width` largest logits, largest first, and their token ids."""
    vocab = logits.shape[1]
    width = min(width, vocab)
    if width > vocab * SORT_ABOVE_SHARE:
        vals, ids = logits.sort(dim=-1, descending=True)
        return vals[:, :width], ids[:, :width]
    return logits.topk(width, dim=-1)


def apply_filters(logits: torch.Tensor, fp: FilterParams) -> Filtered:
    vocab = logits.shape[1]
    if not (fp.max_k or fp.any_top_p):
        return Filtered(_min_p(logits, fp) if fp.any_min_p else logits, None, None)
    width = max(fp.max_k, TOP_P_CANDIDATES if fp.any_top_p else 0)
    vals, _ = candidates(logits, width)
    width = vals.shape[1]
    if fp.max_k:
        k = fp.top_k.clamp(min=1)
        kth = vals.gather(1, (k.clamp(max=width) - 1)[:, None])
        kth = kth.masked_fill((k > width)[:, None], NEG_INF)  # rows without top-k keep everything
        logits = logits.masked_fill(logits < kth, NEG_INF)
        vals = vals.masked_fill(vals < kth, NEG_INF)
    unresolved = None
    after_top_k = logits
    if fp.any_top_p:
        probs = (vals - torch.logsumexp(logits, dim=-1, keepdim=True)).exp()
        cum = probs.cumsum(dim=-1)
        kept = ((cum - probs) < fp.top_p).sum(dim=-1, keepdim=True)  # a prefix of the sorted candidates
        cut = vals.gather(1, kept - 1)
        wants = fp.top_p < 1.0
        beyond = (cum[:, -1:] < fp.top_p) & ((logits > NEG_INF).sum(dim=-1, keepdim=True) > width)
        cut = cut.masked_fill(~wants | beyond, NEG_INF)
        logits = logits.masked_fill(logits < cut, NEG_INF)
        unresolved = (wants & beyond).squeeze(1) if width < vocab else None
    if fp.any_min_p:
        logits = _min_p(logits, fp)
    return Filtered(logits, unresolved, after_top_k)


def _min_p(logits: torch.Tensor, fp: FilterParams) -> torch.Tensor:
    # p < min_p * p_max  <=>  logit < max_logit + log(min_p): no softmax needed
    threshold = logits.amax(dim=-1, keepdim=True) + fp.log_min_p
    return logits.masked_fill(logits < threshold, NEG_INF)


def resolve_top_p(after_top_k: torch.Tensor, fp: FilterParams, rows: torch.Tensor) -> torch.Tensor:
    """The filtered logits of `rows` cut by top-p with a full sort (their nucleus passed the candidates)."""
    logits = after_top_k[rows]
    p = fp.top_p[rows]
    sorted_vals, order = logits.sort(dim=-1, descending=True)
    probs = sorted_vals.softmax(dim=-1)
    drop_sorted = (probs.cumsum(dim=-1) - probs) >= p
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    logits = logits.masked_fill(drop, NEG_INF)
    if fp.any_min_p:
        threshold = logits.amax(dim=-1, keepdim=True) + fp.log_min_p[rows]
        logits = logits.masked_fill(logits < threshold, NEG_INF)
    return logits


def log_or_neg_inf(x: float) -> float:
    return math.log(x) if x > 0 else NEG_INF
