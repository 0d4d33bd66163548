"""One request's state as it moves through the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from worker.engine.detokenizer import IncrementalDetokenizer
from worker.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from worker.engine.pooling import PoolState


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    detokenizer: IncrementalDetokenizer | None  # None: an embedding, which has no output text
    token_ids: list[int] = field(default_factory=list)  # prompt + generated
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)
    block_keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of its full computed blocks
    num_cached_tokens: int = 0  # tokens its latest admission took from the prefix cache
    choice_index: int = 0  # which of the request's n choices this sequence is
    status: SequenceStatus = SequenceStatus.WAITING
    generator: torch.Generator | None = None
    logprobs: list[dict[int, float]] | None = None
    # the detokenizer's text so far (cut at a stop string once one matched), see output_text
    text: str = ""
    detokenized: int = 0  # output tokens the detokenizer has taken
    text_taken: int = 0  # characters of output_text already handed out (streaming)
    first_token_time: float | None = None
    finish_reason: str | None = None
    num_preemptions: int = 0
    priority: int = 0  # lower is seated sooner; equal priorities keep arrival order
    lora: str | None = None  # the LoRA adapter it runs under (None: the base model)
    lora_slot: int = -1  # the device slot holding that adapter while it runs (lora/manager.py), -1 = none
    cache_salt: bytes | None = None  # seeds its prefix-cache keys: an adapter's blocks never serve another
    # an embedding request (pooling.py): prefill only, its rows pooled instead of sampled
    pool_state: PoolState | None = None
    reads_prefix_cache: bool = True  # may take cached blocks (False: its pooling needs every row computed)
    writes_prefix_cache: bool = True  # its full blocks may be cached (False: an encoder's K/V see the whole input)
    whole_prompt: bool = False  # all its tokens in one step, never chunked (an encoder's bidirectional attention)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.params.logprobs is not None:
            self.logprobs = []
        # Stop strings are looked for in the text each token adds, so those sequences detokenize every step;
        # the others only when their text is read (a stream's delta, the result): the same text, fed in
        # chunks (DecodeStream joins chunks as it joins single tokens), off the per-token path
        self.text_each_step = bool(self.params.stop_strings)
        # postprocess's cheap test of whether the new token may end it (StopChecker.check decides): a stop
        # token id, or the length rule
        self.stop_ids = self.params.stop_ids
        # the length rule, its one home: the sequence ends "length" once it holds this many tokens. The context
        # needs no test of its own: Engine.add_request refuses a prompt + max_tokens over it
        self.max_num_tokens = len(self.prompt_token_ids) + self.params.max_tokens
        # its next row may need its newest token on the host (grammar mask, penalties, min_tokens ban): the
        # overlap checks these rows closer (Overlap._may_overlap)
        p = self.params
        self.reads_own_tokens = p.has_penalties or p.min_tokens > 0 or p.grammar is not None

    @property
    def output_text(self) -> str:
        """The output's text: the tokens not detokenized yet are, first."""
        if self.detokenized < len(self.token_ids) - len(self.prompt_token_ids):
            self.detokenize()
        return self.text

    def detokenize(self) -> str:
        """Feed the output tokens the detokenizer has not had yet; returns the text they add."""
        first = len(self.prompt_token_ids) + self.detokenized
        new = self.token_ids[first:]
        if not new:
            return ""
        self.detokenized += len(new)
        text = self.detokenizer.step(new[0]) if len(new) == 1 else self.detokenizer.feed(new)
        if text:
            self.text += text
        return text

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_pending_tokens(self) -> int:
        """Tokens not yet in the KV cache: the whole prompt at first, 1 while decoding."""
        return self.num_tokens - self.num_computed_tokens

    def take_text(self) -> str:
        """Output text not handed out yet. While a stop string may still cut the text, its last
        len(longest stop) - 1 characters wait: they could be the start of one."""
        end = len(self.output_text)
        if end <= self.text_taken:
            return ""
        if self.status is not SequenceStatus.FINISHED and self.params.stop_strings:
            end -= self.params.stop_hold
        if end <= self.text_taken:
            return ""
        text = self.output_text[self.text_taken : end]
        self.text_taken = end
        return text
