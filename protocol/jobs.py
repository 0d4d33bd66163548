"""A job's record as Redis holds it (`{ns}:job:{id}`): its status, the result a worker writes, and `Job`, the
record read back. Part of the wire protocol (docs/protocol.md); re-exported by protocol.models."""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from protocol.priority import Priority


class JobStatus(StrEnum):
    queued = "queued"
    running = "running"
    finished = "finished"
    failed = "failed"
    cancelled = "cancelled"


TERMINAL_STATUSES = frozenset({JobStatus.finished, JobStatus.failed, JobStatus.cancelled})


class Usage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, those the worker's prefix cache held (not computed again)

    def openai(self) -> dict[str, Any]:
        """OpenAI's chat/completions `usage` shape (cached tokens under prompt_tokens_details)."""
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.total_tokens, "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


class TokenText(BaseModel):
    """One token on its own: its text (U+FFFD where it holds part of a character) and its exact bytes."""

    model_config = ConfigDict(extra="ignore")

    text: str
    bytes: list[int]


class ResultChoice(BaseModel):
    """One of a job's n completions."""

    model_config = ConfigDict(extra="ignore")

    index: int
    text: str = ""
    token_ids: list[int] = Field(default_factory=list)
    finish_reason: Literal["stop", "length", "abort"] | None = None
    logprobs: list[dict[int, float]] | None = None


class JobResult(BaseModel):
    """The `result` field of a finished job (JSON). text, token_ids, finish_reason and logprobs are choice 0's;
    `choices` holds every one of the n (usage.completion_tokens counts them all)."""

    model_config = ConfigDict(extra="ignore")

    text: str = ""
    token_ids: list[int] = Field(default_factory=list)
    finish_reason: Literal["stop", "length", "abort"] | None = None
    usage: Usage = Field(default_factory=Usage)
    logprobs: list[dict[int, float]] | None = None  # per generated token: {token_id: logprob}
    # with logprobs: every token id they name (sampled and top candidates) -> its text and bytes
    logprob_tokens: dict[int, TokenText] | None = None
    model: str | None = None  # the worker's model name
    choices: list[ResultChoice] = Field(default_factory=list)  # empty from a worker that wrote none
    # an embedding job's: how many vectors `{ns}:job:{id}:vectors` holds (one per input, in order), their width
    # and dtype (protocol/embeddings.py); usage.prompt_tokens counts every input's tokens
    embeddings: int | None = None
    embedding_dim: int | None = None
    embedding_dtype: str | None = None

    def all_choices(self) -> list[ResultChoice]:
        """The n choices; for a result without `choices`, the one its own fields describe."""
        return self.choices or [ResultChoice(index=0, text=self.text, token_ids=self.token_ids,
                                             finish_reason=self.finish_reason, logprobs=self.logprobs)]


class Job(BaseModel):
    """A job record as read back from `{ns}:job:{id}`."""

    model_config = ConfigDict(extra="ignore")

    id: str
    status: JobStatus
    request: dict[str, Any] | None = None
    created_at: float | None = None  # queued
    started_at: float | None = None  # latest attempt started running
    first_token_at: float | None = None
    finished_at: float | None = None
    attempts: int = 0
    worker: str | None = None
    result: JobResult | None = None
    error: str | None = None
    error_code: str | None = None
    batch_id: str | None = None
    custom_id: str | None = None
    entry_id: str | None = None  # id of its entry in its queue
    queue: str | None = None  # the stream it waits on: {ns}:q:{priority}[:{batch_id}]
    priority: Priority | None = None

    @classmethod
    def from_record(cls, fields: dict[str, str]) -> Job:
        data: dict[str, Any] = dict(fields)
        for key in ("request", "result"):
            if data.get(key):
                try:
                    value = json.loads(data[key])
                except (ValueError, RecursionError):  # not JSON, a huge integer, deep nesting
                    value = None
                if not isinstance(value, dict):
                    value = None if key == "result" else {"_unparsed": data[key]}
                data[key] = value
            else:
                data.pop(key, None)
        return cls.model_validate({k: v for k, v in data.items() if v != ""})

    @property
    def done(self) -> bool:
        return self.status in TERMINAL_STATUSES

    @property
    def queue_seconds(self) -> float | None:
        return _span(self.created_at, self.started_at)

    @property
    def ttft_seconds(self) -> float | None:
        return _span(self.started_at, self.first_token_at)

    @property
    def latency_seconds(self) -> float | None:
        return _span(self.created_at, self.finished_at)


def _span(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else b - a
