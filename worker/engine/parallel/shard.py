"""TpShard: which part of the model one tensor-parallel rank holds, and which slices of each checkpoint
tensor it reads.

    q / k / v          column-parallel by KV head: rank r holds num_kv_heads / N KV heads and the query heads
                       of their groups; with fewer KV heads than ranks (N % num_kv_heads == 0) each KV head is
                       replicated on N / num_kv_heads ranks, each holding a different slice of its query heads
    o_proj             row-parallel: the input columns of the rank's query heads; its output is a partial sum
                       (one all-reduce after it)
    gate / up          column-parallel: intermediate_size / N rows of each (fused gate_up: both halves)
    down_proj          row-parallel: the matching intermediate columns (one all-reduce after it)
    MoE experts        split within each expert, not by expert: every rank holds every expert's
                       intermediate_size / N slice, so the routing, the kernel and the load are the same on
                       every rank whatever the router picks (by expert, a skewed batch would wait on the rank
                       holding the popular experts, and expert counts need not divide N); one all-reduce after
    embed / lm_head    vocabulary-parallel: ceil(vocab / N) rows each (the last rank fewer); the embedding
                       looks up its own rows and all-reduces, rank 0 samples on the gathered logits
    the rest           replicated: norms (q/k norms too: they are per head_dim), the MoE router

Loading reads only these slices (safetensors' get_slice), so a rank's weight memory is about 1/N of the
model plus the replicated tensors.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

Span = tuple[int, int]  # [start, stop) along one dimension
# a checkpoint tensor's share of a rank: the dimension it is cut along and the pieces, concatenated in order
# (a fused tensor, q|k|v or gate|up, gives one piece per part); None = the whole tensor (replicated)
Cut = tuple[int, list[Span]] | None

_ATTN = re.compile(r"self_attn\.(q_proj|k_proj|v_proj|o_proj|qkv_proj)\.(weight|bias)$")
_MLP = re.compile(r"mlp\.(gate_proj|up_proj|down_proj|gate_up_proj)\.weight$")
_EXPERT = re.compile(r"experts\.\d+\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_STACKED = re.compile(r"experts\.(gate_up_proj|down_proj)$")
ROW_PARALLEL = ("o_proj", "down_proj")  # linears whose input is split: partial sums, one all-reduce after each
_VOCAB = re.compile(r"(embed_tokens\.weight|lm_head\.weight)$")


@dataclass(frozen=True)
class TpShard:
    rank: int
    size: int
    num_heads: int  # the model's, all ranks
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    moe_intermediate_size: int  # 0 without experts
    vocab_size: int

    @classmethod
    def of(cls, arch: Any, rank: int, size: int) -> TpShard:
        """The shard of `arch` (a native LlamaArch) rank `rank` of `size` holds; ValueError if it cannot split."""
        moe = getattr(arch, "moe", None)
        shard = cls(rank, size, arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.intermediate_size,
                    moe.intermediate_size if moe is not None else 0, arch.vocab_size)
        shard.check(arch.model_type)
        return shard

    def check(self, model_type: str) -> None:
        n, kv = self.size, self.num_kv_heads
        problems = []
        if self.num_heads % n:
            problems.append(f"{self.num_heads} attention heads do not split over {n} ranks")
        if (kv >= n and kv % n) or (kv < n and n % kv):
            problems.append(f"{kv} KV heads do not split over {n} ranks (nor replicate evenly: {n} % {kv} != 0)")
        if self.intermediate_size % n:
            problems.append(f"intermediate_size {self.intermediate_size} does not split over {n} ranks")
        if self.moe_intermediate_size % n:
            problems.append(f"the experts' intermediate size {self.moe_intermediate_size} does not split over {n}")
        if problems:
            raise ValueError(f"tensor_parallel_size {n} cannot shard this {model_type} model: "
                             + "; ".join(problems) + ": choose a size that divides them")

    # ---- what this rank holds -------------------------------------------------------------------------------

    @property
    def local_heads(self) -> int:
        return self.num_heads // self.size

    @property
    def local_kv_heads(self) -> int:
        return max(1, self.num_kv_heads // self.size)

    @property
    def kv_replicated(self) -> bool:
        return self.num_kv_heads < self.size

    def q_span(self) -> Span:
        start = self.rank * self.local_heads
        return start * self.head_dim, (start + self.local_heads) * self.head_dim

    def kv_span(self) -> Span:
        # replicated: rank r's query heads belong to KV head r // (N / num_kv_heads)
        first = self.rank // (self.size // self.num_kv_heads) if self.kv_replicated else self.rank * self.local_kv_heads
        return first * self.head_dim, (first + self.local_kv_heads) * self.head_dim

    def inter_span(self, size: int) -> Span:
        part = size // self.size
        return self.rank * part, (self.rank + 1) * part

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.vocab_size // self.size)

    def vocab_span(self) -> Span:
        start = min(self.rank * self.vocab_per_rank, self.vocab_size)
        return start, min(start + self.vocab_per_rank, self.vocab_size)

    def local_arch(self, arch: Any) -> Any:
        """arch with this rank's head counts and intermediate sizes (vocab_size stays the model's: the
        tokenizer, the sampler and the logits it gathers see the whole vocabulary)."""
        fields: dict[str, Any] = dict(num_heads=self.local_heads, num_kv_heads=self.local_kv_heads,
                                      intermediate_size=self.intermediate_size // self.size)
        moe = getattr(arch, "moe", None)
        if moe is not None:
            fields["moe"] = dataclasses.replace(moe, intermediate_size=self.moe_intermediate_size // self.size)
        return dataclasses.replace(arch, **fields)

    # ---- which slices of a checkpoint tensor ----------------------------------------------------------------

    def cut(self, name: str, shape: list[int]) -> Cut:
        """This rank's share of the checkpoint tensor `name` of `shape` (see Cut)."""
        q, kv = self.q_span(), self.kv_span()
        inter, moe_inter = self.inter_span(self.intermediate_size), self.inter_span(self.moe_intermediate_size)
        if m := _ATTN.search(name):
            proj, kind = m.groups()
            if proj == "q_proj":
                return 0, [q]
            if proj in ("k_proj", "v_proj"):
                return 0, [kv]
            if proj == "o_proj":
                return (1, [q]) if kind == "weight" else None  # a row-parallel bias is added once, after the sum
            qs, kvs = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim  # fused q|k|v (Phi-3)
            return 0, [q, _shift(kv, qs), _shift(kv, qs + kvs)]
        if m := _EXPERT.search(name):
            return (1, [moe_inter]) if m.group(1) in ("w2", "down_proj") else (0, [moe_inter])
        if m := _STACKED.search(name):  # [experts, 2 * inter, hidden] and [experts, hidden, inter]
            if m.group(1) == "down_proj":
                return 2, [moe_inter]
            return 1, [moe_inter, _shift(moe_inter, self.moe_intermediate_size)]
        if m := _MLP.search(name):
            proj = m.group(1)
            if proj == "down_proj":
                return 1, [inter]
            if proj == "gate_up_proj":
                return 0, [inter, _shift(inter, self.intermediate_size)]
            return 0, [inter]
        if _VOCAB.search(name):
            return 0, [self.vocab_span()]
        return None

    def read(self, handle: Any, name: str) -> torch.Tensor:
        """This rank's share of `name` from an open safetensors file: only those bytes are read."""
        piece = handle.get_slice(name)
        cut = self.cut(name, piece.get_shape())
        if cut is None:
            return piece[:]
        dim, spans = cut
        lead = (slice(None),) * dim
        parts = [piece[(*lead, slice(a, b))] for a, b in spans]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)

    def iter_weights(self, files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import safe_open

        for path in files:
            with safe_open(path, framework="pt") as handle:
                for name in handle.keys():
                    yield name, self.read(handle, name)


def _shift(span: Span, by: int) -> Span:
    return span[0] + by, span[1] + by
