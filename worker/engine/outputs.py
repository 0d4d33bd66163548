"""What the engine hands back: a finished request (RequestOutput with its Choices), what a step added to a
running one (Delta), and the engine's counters (EngineStats)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from worker.engine.sequence import Sequence


@dataclass
class Choice:
    """One of a request's n completions."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[dict[int, float]] | None


@dataclass
class RequestOutput:
    """A finished request. token_ids, text, finish_reason and logprobs are choice 0's; `choices` holds all n.
    An embedding request's has no tokens or text: its `embedding` (finish_reason "stop")."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length" | "abort"
    logprobs: list[dict[int, float]] | None
    arrival_time: float
    first_token_time: float | None
    finish_time: float
    num_preemptions: int
    num_cached_tokens: int = 0  # prompt tokens its latest admission took from the prefix cache
    choices: list[Choice] = field(default_factory=list)
    embedding: torch.Tensor | None = None  # float32 [width or dimensions] on the host: an embedding request's


class Delta:
    """What one step added to a request's output: its new token ids and the text that is final now. The text
    is taken from the sequence when first read (only a streamed request's is): read it before the next step."""

    __slots__ = ("token_ids", "_text", "_seq")

    def __init__(self, token_ids: list[int], text: str | None = None, seq: Sequence | None = None) -> None:
        self.token_ids = token_ids
        self._text = text
        self._seq = seq

    @property
    def text(self) -> str:
        if self._text is None:
            self._text = self._seq.take_text() if self._seq is not None else ""
        return self._text

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Delta) and (self.token_ids, self.text) == (other.token_ids, other.text)

    def __repr__(self) -> str:
        return f"Delta(token_ids={self.token_ids!r}, text={self.text!r})"


class StepDeltas(Mapping[str, Delta]):
    """Engine.deltas: request id -> Delta of every request whose choice 0 sampled in the last step. Built on
    first read (the text is detokenized then), so a step whose deltas nobody reads (offline generate) pays
    nothing for them; a Delta's text is detokenized when read (a streamed request's). Read it before the next
    step."""

    def __init__(self, sampled: list[Sequence] | None = None, tokens: list[int] | None = None) -> None:
        self._sampled = sampled or []
        self._tokens = tokens or []
        self._built: dict[str, Delta] | None = None

    def _deltas(self) -> dict[str, Delta]:
        if self._built is None:
            self._built = {seq.request_id: Delta([token], seq=seq)
                           for seq, token in zip(self._sampled, self._tokens, strict=True) if seq.choice_index == 0}
        return self._built

    def __getitem__(self, request_id: str) -> Delta:
        return self._deltas()[request_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._deltas())

    def __len__(self) -> int:
        return len(self._deltas())


@dataclass
class EngineStats:
    running: int
    waiting: int  # choices 1..n-1 waiting to fork are not here: see forking
    free_blocks: int
    used_blocks: int
    total_blocks: int
    preemptions: int
    generated_tokens: int
    steps: int
    cached_blocks: int = 0  # blocks holding a reusable prefix (in use or in the LRU)
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    prefix_queried_blocks: int = 0
    prefix_hit_blocks: int = 0
    prefix_evictions: int = 0
    forking: int = 0  # choices 1..n-1 of n > 1 requests, waiting for choice 0's first token to fork
    lora_loads: int = 0  # LoRA adapters copied into a device slot (each eviction's reload counts)
    lora_disk_reads: int = 0  # adapters read from their directories (registration included)
    loras_registered: int = 0
    loras_resident: int = 0  # adapters in a device slot now
    # cascade decode attention (worker/engine/cascade.py): steps that ran it, the groups and rows they
    # cascaded, and the KV tokens (per layer) decode attention read against what plain decode would read
    cascade_steps: int = 0
    cascade_groups: int = 0
    cascade_grouped_rows: int = 0
    decode_kv_tokens_read: int = 0
    decode_kv_tokens_plain: int = 0
