"""What the serve loop's threads hand each other through queue.Queue: plain dataclasses, no Redis, no torch.

    intake thread ──StartedJob──▶ engine thread ──Ending / HandBack / Partial──▶ completion writer
    housekeeper   ──Revoke─────▶ engine thread
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from protocol.models import JobRequest
from protocol.priority import Priority

if TYPE_CHECKING:
    from worker.engine.sampling_params import SamplingParams


@dataclass
class StartedJob:
    """A validated job whose record is `running` on this worker and whose stream entry this worker holds."""

    job_id: str
    entry_id: str
    request: JobRequest
    params: SamplingParams
    attempts: int
    started_at: float  # unix time the start script ran
    stream: bool = False  # publish partial tokens
    queue: str = ""  # the stream its entry is in
    priority: Priority = Priority.default  # the request's (the engine seats lower ranks first)
    model: str = ""  # the id of the model that serves it (its result's `model`; '' = the engine's name)
    # owned by the engine thread once the job is in the engine
    first_token_at: float | None = None
    published: int = 0  # tokens already sent as Partials
    published_chars: int = 0  # and the length of their text


@dataclass
class Revoke:
    """Take a job out of the engine: the client cancelled it, or this worker's lease on it was lost."""

    job_id: str
    reason: str  # "cancel" | "lost"


@dataclass
class HandBack:
    """Give a started job back to the queue unfinished (drain, or a failed engine step)."""

    job_id: str
    entry_id: str
    count_attempt: bool
    why: str
    queue: str = ""  # the stream its entry is in


@dataclass
class Partial:
    """What a streaming job gained since its last Partial: tokens, and the text that is final now (the engine's
    detokenizer's, so the parts join to the job's result text). `offset` = tokens published before these."""

    job_id: str
    token_ids: list[int]
    offset: int
    text: str = ""
    done: bool = False


@dataclass
class Wake:
    """Wakes the engine thread from its idle wait (a signal arrived)."""

    why: str = ""
