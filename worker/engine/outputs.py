"""What the engine hands back: a finished request (RequestOutput with its Choices), what a step added to a
running one (Delta), and the engine's counters (EngineStats)."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    """A finished request. token_ids, text, finish_reason and logprobs are choice 0's; `choices` holds all n."""

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


@dataclass
class Delta:
    """What one step added to a request's output: its new token ids and the text that is final now."""

    token_ids: list[int]
    text: str


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
