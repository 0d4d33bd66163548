"""The completion writer: the thread that writes every job's ending back to Redis the moment it is known.

The engine thread only puts messages on a queue.Queue; this thread batches whatever is waiting into one
pipeline (finish scripts, hand-backs, partial tokens) and retries it with backoff while Redis is away. The
finish script is idempotent, so re-sending a pipeline whose outcome is unknown never ends a job twice.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import structlog

from protocol.records import DeadLetter
from worker.serve.backoff import REDIS_DOWN, Backoff
from worker.serve.job_queue import Ending, JobQueue
from worker.serve.leases import Leases
from worker.serve.messages import HandBack, Partial

log = structlog.get_logger("tokenbus.worker")

MAX_BATCH = 256  # messages per pipeline


@dataclass
class EndMsg:
    ending: Ending
    dead: DeadLetter | None = None  # dead-letter it too (attempts exhausted)
    orphan: DeadLetter | None = None  # dead-letter it only if it has no record to fail
    started_at: float | None = None
    first_token_at: float | None = None
    finish_reason: str | None = None
    completion_tokens: int = 0


@dataclass
class FirstToken:
    job_id: str
    at: float


class CompletionWriter(threading.Thread):
    def __init__(self, jobs: JobQueue, leases: Leases, metrics: Any | None = None) -> None:
        super().__init__(name="tokenbus-writer", daemon=True)
        self.jobs = jobs
        self.leases = leases
        self.metrics = metrics
        self.inbox: queue.Queue = queue.Queue()
        self.stop_event = threading.Event()
        self._close_deadline: float | None = None
        self._unwritten: dict[str, Partial] = {}  # job -> its chunk in `pending`, still growing
        self.jobs_done = 0
        self.gave_up = False  # closed with results unwritten (Redis away): their leases lapse, they re-run

    # ---- called from other threads ------------------------------------------------------------------

    def end(self, ending: Ending, dead: DeadLetter | None = None, orphan: DeadLetter | None = None,
            **stats: Any) -> None:
        self.inbox.put(EndMsg(ending, dead, orphan, **stats))

    def put(self, msg: HandBack | Partial | FirstToken) -> None:
        self.inbox.put(msg)

    def close(self, timeout: float) -> bool:
        """Write what is queued (waiting up to `timeout` for Redis), then stop. True if all was written."""
        self._close_deadline = time.monotonic() + timeout
        self.inbox.put(None)
        self.join(timeout + 5)
        return self.inbox.empty() and not self.is_alive() and not self.gave_up

    # ---- the thread ---------------------------------------------------------------------------------

    def run(self) -> None:
        # Short backoff: results wait in memory, and they should reach Redis soon after it is back.
        backoff = Backoff("writing results", self.stop_event, max_s=1.0)
        pending: list[Any] = []
        closing = False
        while True:
            closing = self._gather(pending, block=not pending) or closing
            if pending:
                try:
                    self._write(pending)
                    pending = []
                    self._unwritten.clear()
                    backoff.succeeded()
                except REDIS_DOWN as err:
                    if closing and time.monotonic() > (self._close_deadline or 0):
                        log.error("results_not_written", count=len(pending), error=str(err))
                        self.gave_up = True
                        return
                    backoff.failed(err)
                except Exception:
                    # A message Redis refuses (a bug, not an outage) must not wedge every later result.
                    log.exception("write_error", messages=len(pending))
                    pending = []
                    self._unwritten.clear()
            if closing and not pending and self.inbox.empty():
                return

    def _gather(self, pending: list[Any], block: bool) -> bool:
        """Move waiting messages into `pending`; True once the close marker was seen."""
        closing = False
        try:
            msg = self.inbox.get(timeout=0.2) if block else self.inbox.get_nowait()
        except queue.Empty:
            return False
        while True:
            if msg is None:
                closing = True
            else:
                self._add(pending, msg)
            if len(pending) >= MAX_BATCH:
                break
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                break
        return closing

    def _add(self, pending: list[Any], msg: Any) -> None:
        if not isinstance(msg, Partial):
            pending.append(msg)
            return
        chunk = self._unwritten.get(msg.job_id)
        if chunk is not None:  # Redis is behind (or away): one entry per job per write, not per step
            chunk.token_ids += msg.token_ids
            chunk.text += msg.text
            chunk.done = msg.done
            return
        chunk = Partial(msg.job_id, list(msg.token_ids), msg.offset, msg.text, msg.done)
        self._unwritten[msg.job_id] = chunk
        pending.append(chunk)

    def _write(self, pending: list[Any]) -> None:
        batch = self.jobs.write_batch()
        finish_at: list[tuple[int, EndMsg]] = []
        for msg in pending:
            if isinstance(msg, EndMsg):
                if msg.dead is not None:
                    batch.dead_letter(msg.dead)
                finish_at.append((batch.finish(msg.ending), msg))
            elif isinstance(msg, HandBack):
                batch.hand_back(msg.job_id, msg.entry_id, msg.queue, msg.count_attempt)
            elif isinstance(msg, FirstToken):
                batch.first_token(msg.job_id, msg.at)
            elif isinstance(msg, Partial):
                batch.publish_tokens(msg.job_id, msg.offset, msg.token_ids, msg.text, msg.done)
        replies = batch.execute()
        orphans = [m for i, m in finish_at if int(replies[i]) == -1 and m.orphan is not None]
        if orphans:
            batch = self.jobs.write_batch()
            for m in orphans:
                batch.dead_letter(m.orphan)
            batch.execute()
        for i, m in finish_at:
            self._ended(m, int(replies[i]))
        for msg in pending:
            if isinstance(msg, HandBack):
                self.leases.release(msg.job_id, msg.entry_id)
                log.info("job_handed_back", job_id=msg.job_id, entry_id=msg.entry_id, why=msg.why)

    def _ended(self, m: EndMsg, outcome: int) -> None:
        e = m.ending
        self.leases.release(e.job_id, e.entry_id)
        if outcome != 1:
            what = {0: "job_already_ended", -1: "job_without_record"}.get(outcome, "job_end_refused")
            log.info(what, job_id=e.job_id, entry_id=e.entry_id, status=e.status)
            return
        self.jobs_done += 1
        fields: dict[str, Any] = {"job_id": e.job_id, "entry_id": e.entry_id}
        if e.status == "failed":
            log.warning("job_failed", **fields, error=e.error, error_code=e.error_code)
        else:
            fields.update(finish_reason=m.finish_reason, completion_tokens=m.completion_tokens)
            if m.started_at is not None and e.finished_at is not None:
                fields["run_s"] = round(e.finished_at - m.started_at, 4)
            log.info("job_" + e.status, **fields)
        if self.metrics is not None:
            reason = m.finish_reason if e.status != "failed" else (e.error_code or "error")
            latency = e.finished_at - m.started_at if m.started_at and e.finished_at else None
            ttft = m.first_token_at - m.started_at if m.started_at and m.first_token_at else None
            self.metrics.job_finished(e.status, reason or "", latency, ttft, m.completion_tokens)
