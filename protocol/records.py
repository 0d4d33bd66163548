"""Records of the queue's state as Redis holds them: a worker's heartbeat, a batch's record, a dead letter, and
the summary `Client.info()` builds from them. Part of the wire protocol (docs/protocol.md)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from protocol.models import TERMINAL_BATCH_STATUSES, BatchStatus
from protocol.priority import Priority


@dataclass(frozen=True)
class DeadLetter:
    """An entry of `{ns}:dead`: a job no worker could run, kept with its request (the worker writes it with the
    job's failed ending; the dashboard reads, re-runs or deletes it)."""

    job_id: str
    reason: str
    attempts: int
    request: str  # the entry's request text as it was read
    worker: str = ""  # the consumer that gave up on it
    at: float | None = None  # when (epoch seconds)

    def fields(self, worker: str) -> dict[str, str | int]:
        """The stream entry's fields, written by `worker` now."""
        return {"job_id": self.job_id, "reason": self.reason, "attempts": self.attempts, "request": self.request,
                "worker": worker, "at": repr(time.time())}

    @classmethod
    def from_fields(cls, fields: dict[str, str]) -> DeadLetter:
        """An entry read back; a field missing or unreadable reads as empty (entries of older releases)."""
        try:
            at: float | None = float(fields.get("at", ""))
        except ValueError:
            at = None
        attempts = fields.get("attempts", "0")
        return cls(fields.get("job_id", ""), fields.get("reason", ""), int(attempts) if attempts.isdigit() else 0,
                   fields.get("request", ""), fields.get("worker", ""), at)


class Heartbeat(BaseModel):
    """The JSON value of `{ns}:worker:{name}` (kept alive by a TTL the worker refreshes)."""

    model_config = ConfigDict(extra="ignore")

    name: str
    pid: int | None = None
    model: str | None = None  # the id of the model it serves (before models: its --model value)
    models: list[str] = Field(default_factory=list)  # the ids of every model whose queues it reads
    serves_default: bool = False  # it reads the default queues too (it serves the default model)
    kinds: list[str] = Field(default_factory=list)  # the job kinds it serves: generate, embed ([]: generate)
    model_path: str | None = None  # which code runs the model: "native" (tokenbus's) or "transformers" (fallback)
    backend: str | None = None  # which kernels run it: "cpu-cpp", "triton", "triton-interpreter", "torch-reference"
    device: str | None = None  # where: "cpu", "cuda:0"
    started_at: float | None = None
    last_seen: float | None = None
    running: int = 0
    waiting: int = 0
    free_blocks: int | None = None
    used_blocks: int | None = None
    jobs_done: int = 0
    generated_tokens: int = 0  # since the engine started (the dashboard's tokens/s is its rate)
    step_ms: list[float] = Field(default_factory=list)  # the latest steps' wall times, oldest first (<= 32)
    draining: bool = False  # stopping: takes no new jobs, hands back what it has not started
    # LoRA adapters (docs/adapters.md): the ones it serves (loaded, declared, their queues read), why each one it
    # refused was refused, and the revision of {ns}:adapters it has applied (what `tokenbus adapters` waits for)
    adapters: list[str] = Field(default_factory=list)
    adapter_errors: dict[str, str] = Field(default_factory=dict)
    adapters_rev: int = 0
    # the prefix cache since the worker's engine started: prompt tokens / full blocks looked up and found
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    prefix_queried_blocks: int = 0
    prefix_hit_blocks: int = 0

    @model_validator(mode="before")
    @classmethod
    def _read_serving_path(cls, data: Any) -> Any:
        """Workers up to 0.2.0 sent backend and device as one string, serving_path = "cpu-cpp on cpu"."""
        if isinstance(data, dict) and isinstance(data.get("serving_path"), str) and "backend" not in data:
            backend, _, device = data["serving_path"].partition(" on ")
            data = {**data, "backend": backend, "device": device or None}
        return data

    @classmethod
    def parse(cls, raw: str | None) -> Heartbeat | None:
        """A heartbeat key's value; None for a missing or unreadable one."""
        if raw is None:
            return None
        try:
            return cls.model_validate(json.loads(raw))
        except (ValueError, TypeError):
            return None

    def served(self) -> list[str]:
        """The ids of the models whose queues it reads, '' for the default queues (a worker from before models
        read only those)."""
        if not self.models:
            return [""]
        return [*self.models, *([""] if self.serves_default else [])]

    @property
    def prefix_hit_rate(self) -> float | None:
        """Share of looked-up prompt tokens served from the prefix cache (None before any lookup)."""
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else None


class WorkerInfo(BaseModel):
    name: str
    alive: bool  # its heartbeat key still exists
    heartbeat: Heartbeat | None = None


class ModelInfo(BaseModel):
    """One declared model (or, with id '', the default queues) as `tokenbus info` and the dashboard show it."""

    id: str
    names: list[str] = Field(default_factory=list)
    kind: str = ""
    kinds: list[str] = Field(default_factory=list)  # every job kind its workers serve (generate, embed)
    parent: str | None = None  # a LoRA adapter's base model
    root: str | None = None  # its weights' source (ModelRecord.root)
    default: bool = False  # the namespace's default model: its workers also read the default queues
    context_length: int | None = None
    queue_depth: int = 0  # entries in its queues: queued + running
    pending: int = 0  # delivered to a worker, not acked yet
    by_priority: dict[str, int] = Field(default_factory=dict)
    workers: int = 0  # live workers serving it
    unserved: bool = False  # jobs in its queues and no live worker: they wait until one starts


class QueueInfo(BaseModel):
    namespace: str
    queue_depth: int  # entries in every queue: queued + running (ended ones are XDELed); the depth counter
    pending: int  # delivered to a worker by READ, not acked yet (the depth counter's `pending`)
    waiting: int  # queue_depth - pending: not picked up yet
    by_priority: dict[str, int] = Field(default_factory=dict)  # queue_depth of each priority
    queues: int = 0  # non-empty loose queues + live batch queues (in a registry)
    consumers: int  # workers whose heartbeat is live (each reads as one consumer of the group)
    workers: list[WorkerInfo]
    dead_letters: int
    cancel_requested: int
    max_queue_len: int
    result_ttl: int
    models: list[ModelInfo] = Field(default_factory=list)  # each declared model, the default queues ('')


class BatchRecord(BaseModel):
    """`{ns}:batch:{id}` hash."""

    model_config = ConfigDict(extra="ignore")

    id: str
    status: BatchStatus
    endpoint: str
    total: int
    finished: int = 0
    failed: int = 0
    cancelled: int = 0
    created_at: float | None = None
    in_progress_at: float | None = None
    completed_at: float | None = None
    cancelled_at: float | None = None  # when cancel was requested
    input_file: str | None = None
    priority: str = Priority.default.value  # of every job of the batch (batches.submit_batch: bulk)
    queue: str | None = None  # its jobs' stream, {ns}:q:{priority}:{id}; leaves the registry when it ends
    # token counts of its finished jobs, summed by FINISH_JOB as each ends (exact once the batch has ended)
    input_tokens: int = 0
    cached_tokens: int = 0  # of input_tokens, prefix-cache hits
    output_tokens: int = 0
    retry_of: str | None = None  # the ended batch whose unfinished lines this one re-runs (producer/batch_retry.py)
    retried_by: str | None = None  # the batch that re-runs this one's unfinished lines

    @property
    def done(self) -> int:
        return self.finished + self.failed + self.cancelled

    @property
    def is_terminal(self) -> bool:
        return self.status in TERMINAL_BATCH_STATUSES

    @classmethod
    def from_record(cls, fields: dict[str, str]) -> BatchRecord:
        return cls.model_validate({k: v for k, v in fields.items() if v != ""})
