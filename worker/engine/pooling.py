"""Embeddings: how a sequence's hidden states become its vector, as the checkpoint defines it.

The rule comes from the checkpoint's sentence-transformers modules when it has them (modules.json: a
Transformer, then a Pooling whose 1_Pooling/config.json names the mode, then maybe a Normalize), else from the
model's kind: an encoder takes its CLS token, a decoder its last token, both normalized. Modes: `cls` (the first
position), `mean` (and `mean_sqrt_len_tokens`), `max`, `lasttoken`.

A sequence's positions may arrive over several steps (chunked prefill of a causal model): each step folds the
rows it computed into the sequence's PoolState (a running sum, max, first or last row), and the step that
computes its last position finishes the vector: divided by the count, normalized, copied to the host.

Exact with the prefix cache? Only what a cold run would compute may be returned:
    causal model, lasttoken     reads cached blocks: the last position is always computed (match_prefix keeps
                                it out) and its hidden state depends only on the K/V before it, which the
                                cache holds as a cold run would compute them
    causal model, other modes   never reads them (mean, max and cls need the hidden state of every position,
                                or the first, and a cache hit skips those rows); still writes its full blocks,
                                whose K/V are any causal run's
    encoder (non-causal)        neither reads nor writes: every position's K/V depends on the whole input
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from worker.engine.errors import InvalidRequest

MODES = ("cls", "mean", "mean_sqrt_len_tokens", "max", "lasttoken")
_LEGACY_KEYS = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
                "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens", "pooling_mode_max_tokens": "max",
                "pooling_mode_lasttoken": "lasttoken", "pooling_mode_weightedmean_tokens": "weightedmean"}


@dataclass(frozen=True)
class EmbedParams:
    """What an embedding request asks: `dimensions` keeps the vector's first that many entries (Matryoshka),
    renormalized when the model's vectors are normalized; `truncate` cuts an input longer than the context to
    it (text as the tokenizer truncates, keeping its special tokens) instead of refusing it."""

    dimensions: int | None = None
    truncate: bool = False

    def __post_init__(self) -> None:
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise InvalidRequest(f"dimensions must be a positive integer, got {self.dimensions!r}")


@dataclass(frozen=True)
class Pooling:
    """A model's rule: mode, whether vectors are L2-normalized, their width, where the rule came from."""

    mode: str
    normalize: bool
    dimension: int
    source: str  # "sentence-transformers" (modules.json) or "default" (the model's kind)
    max_seq_length: int | None = None  # sentence_bert_config.json: the context the model was trained to
    lowercase: bool = False  # sentence_bert_config.json's do_lower_case: the text is lowercased first

    def reads_prefix_cache(self, causal: bool) -> bool:
        return causal and self.mode == "lasttoken"


def load_pooling(directory: str, hidden_size: int, causal: bool) -> Pooling:
    """The checkpoint's rule (module docstring); ValueError naming the file and what it holds that tokenbus does
    not serve (a Dense layer, weighted-mean or several concatenated modes)."""
    modules_file = os.path.join(directory, "modules.json")
    if not os.path.isfile(modules_file):
        return Pooling("lasttoken" if causal else "cls", True, hidden_size, "default")
    with open(modules_file) as f:
        modules = sorted(json.load(f), key=lambda m: m.get("idx", 0))
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
    if not kinds or kinds[0] != "Transformer" or "Pooling" not in kinds:
        raise ValueError(f"{modules_file}: tokenbus serves a Transformer followed by a Pooling (and maybe a "
                         f"Normalize); this checkpoint's modules are {kinds}")
    extra = [k for k in kinds[1:] if k not in ("Pooling", "Normalize")]
    if extra:
        raise ValueError(f"{modules_file}: module(s) {extra} after the pooling are not served by tokenbus "
                         "(only Pooling and Normalize are)")
    pooling_dir = os.path.join(directory, modules[kinds.index("Pooling")].get("path", "1_Pooling"))
    with open(os.path.join(pooling_dir, "config.json")) as f:
        config = json.load(f)
    mode = _mode(config, pooling_dir)
    width = config.get("embedding_dimension", config.get("word_embedding_dimension", hidden_size))
    if width != hidden_size:
        raise ValueError(f"{pooling_dir}/config.json says the embeddings are {width} wide; the model's hidden size "
                         f"is {hidden_size}")
    st_config = {}
    if os.path.isfile(path := os.path.join(directory, "sentence_bert_config.json")):
        with open(path) as f:
            st_config = json.load(f)
    return Pooling(mode, "Normalize" in kinds, hidden_size, "sentence-transformers",
                   st_config.get("max_seq_length"), bool(st_config.get("do_lower_case", False)))


def _mode(config: dict, where: str) -> str:
    modes = config.get("pooling_mode")
    if modes is None:  # sentence-transformers < 5: one boolean per mode
        modes = [mode for key, mode in _LEGACY_KEYS.items() if config.get(key)]
    modes = [modes] if isinstance(modes, str) else list(modes)
    if len(modes) != 1 or modes[0] not in MODES:
        raise ValueError(f"{where}/config.json pools by {modes}; tokenbus serves exactly one of {list(MODES)}")
    return modes[0]


@dataclass(eq=False)
class PoolState:
    """One sequence's pooling so far: acc is the running sum (mean), max, or the chosen row (cls, lasttoken),
    float32 on the device; vector the finished full-width vector, float32 on the host."""

    params: EmbedParams
    acc: torch.Tensor | None = None
    count: int = 0
    vector: torch.Tensor | None = None

    def reset(self) -> None:
        """Preempted: the sequence is computed again from its first position."""
        self.acc, self.count, self.vector = None, 0, None


# a pooled row group of one step: (the Sequence, whose pool_state it folds into; first row of the step's hidden
# states, rows, position of the first row, whether the group ends the sequence). Any: sequence.py imports this
PooledRows = tuple[Any, int, int, int, bool]


class Pooler:
    def __init__(self, pooling: Pooling) -> None:
        self.pooling = pooling

    @torch.inference_mode()
    def __call__(self, hidden: torch.Tensor, groups: list[PooledRows]) -> None:
        """Fold one step's rows into their sequences' states; finish the vectors of those the step ends."""
        mode, device = self.pooling.mode, hidden.device
        part = self._reduce(hidden, groups)
        finished: list[PoolState] = []
        for i, (seq, row, n, start, last) in enumerate(groups):
            state = seq.pool_state
            if mode == "cls":
                if start == 0:
                    state.acc = hidden[row].float()
            elif mode == "lasttoken":
                if last:
                    state.acc = hidden[row + n - 1].float()
            elif state.acc is None:
                state.acc = part[i]
            else:  # a later chunk of a chunked prefill
                state.acc = torch.maximum(state.acc, part[i]) if mode == "max" else state.acc + part[i]
            state.count += n
            if last:
                finished.append(state)
        if not finished:
            return
        vectors = torch.stack([s.acc for s in finished])
        if mode in ("mean", "mean_sqrt_len_tokens"):
            counts = torch.tensor([[s.count] for s in finished], dtype=torch.float32, device=device)
            vectors = vectors / (counts if mode == "mean" else counts.sqrt())
        if self.pooling.normalize:
            vectors = F.normalize(vectors, p=2, dim=1)  # as sentence-transformers' Normalize
        for state, vector in zip(finished, vectors.cpu(), strict=True):
            state.vector = vector

    def _reduce(self, hidden: torch.Tensor, groups: list[PooledRows]) -> torch.Tensor | None:
        """Per group, the sum (mean modes) or max of its rows, one batched op for the whole step."""
        mode = self.pooling.mode
        if mode in ("cls", "lasttoken"):
            return None
        rows: list[int] = []
        segments: list[int] = []
        for i, (_, row, n, _, _) in enumerate(groups):
            rows += range(row, row + n)
            segments += [i] * n
        device = hidden.device
        src = hidden.index_select(0, torch.tensor(rows, device=device)).float()
        index = torch.tensor(segments, device=device)
        out = torch.zeros(len(groups), hidden.shape[1], device=device)
        if mode == "max":
            return out.scatter_reduce_(0, index[:, None].expand_as(src), src, "amax", include_self=False)
        return out.index_add_(0, index, src)


def output_vector(pooling: Pooling, state: PoolState) -> torch.Tensor:
    """The request's vector: the finished one, cut to `dimensions` (and renormalized) if asked."""
    vector = state.vector
    assert vector is not None, "the sequence ended before its last position was pooled"
    dims = state.params.dimensions
    if dims is None or dims == vector.shape[0]:
        return vector
    vector = vector[:dims].clone()
    return F.normalize(vector, p=2, dim=0) if pooling.normalize else vector
