"""Intake: the thread that reads jobs from the stream, only as many as the engine can seat soon.

Per entry: validate (protocol, model, sampling params) -> start script (record `running`, attempts + 1) ->
hand the job to the engine thread. Bad entries end here, failed with the reason; they never reach the engine.
"""

from __future__ import annotations

import queue
import threading
import time

import structlog

from protocol.errors import InvalidJob
from protocol.models import ErrorCode, JobRequest, is_valid_id, parse_request
from protocol.priority import Priority
from protocol.records import DeadLetter
from protocol.scripts import RetryBackoff
from worker.engine.sampling_params import SamplingParams
from worker.serve.backoff import REDIS_DOWN, Backoff
from worker.serve.completion import CompletionWriter
from worker.serve.job_queue import Ending, Entry, JobQueue
from worker.serve.leases import Leases
from worker.serve.messages import StartedJob
from worker.serve.served import ServedModels

log = structlog.get_logger("tokenbus.worker")

BLOCK_MS = 500  # longest XREADGROUP wait: bounds how late intake notices a stop


class ModelMismatch(InvalidJob):
    """The job names a model this worker does not serve."""


class IntakeBudget:
    """How many more jobs intake may read: the engine's room (seats + look-ahead - running - waiting), set
    by the engine thread after every step, minus the jobs read and not yet taken by the engine.

    With `leases` and `limit` (the worker's capacity, max_num_seqs + intake_lookahead) it is also never more
    than `limit - len(leases)`: the lease registry holds every job this worker started and has not yet
    ended *in Redis* (in transit, in the engine, set aside, or ended with its result still being written),
    so one read - XAUTOCLAIM and XREADGROUP together - can never take the worker past its limit."""

    def __init__(self, room: int, leases: Leases | None = None, limit: int | None = None) -> None:
        self._cond = threading.Condition()
        self._room = room
        self._in_transit = 0
        self._leases = leases
        self._limit = limit if limit is not None else room

    def _allowance(self) -> int:
        free = self._room - self._in_transit
        if self._leases is not None:
            free = min(free, self._limit - len(self._leases))
        return free

    def set_room(self, room: int) -> None:
        with self._cond:
            self._room = room
            if self._allowance() > 0:
                self._cond.notify_all()

    def wait(self, timeout: float) -> int:
        with self._cond:
            self._cond.wait_for(lambda: self._allowance() > 0, timeout)
            return max(0, self._allowance())

    def sent(self, n: int = 1) -> None:
        with self._cond:
            self._in_transit += n

    def taken(self, n: int = 1) -> None:
        """The engine took n jobs: no longer in transit, and they hold n of the room until the next set_room
        (without this the room set before they arrived was counted again: one worker read 2x its capacity)."""
        with self._cond:
            self._in_transit -= n
            self._room -= n

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()


class Intake(threading.Thread):
    def __init__(
        self,
        jobs: JobQueue,
        leases: Leases,
        budget: IntakeBudget,
        engine_inbox: queue.Queue,
        writer: CompletionWriter,
        model_names: set[str],
        lease_ms: int,
        max_attempts: int,
        stream_tokens: bool,
        bulk_min_seats: int = 0,
        served: ServedModels | None = None,
        retry_backoff: RetryBackoff | None = None,
    ) -> None:
        super().__init__(name="tokenbus-intake", daemon=True)
        self.jobs = jobs
        self.leases = leases
        self.budget = budget
        self.engine_inbox = engine_inbox
        self.writer = writer
        self.model_names = model_names
        self.served = served  # which queue is which model's (a job on its model's queue needs no model check)
        self.lease_ms = lease_ms
        self.max_attempts = max_attempts
        self.stream_tokens = stream_tokens
        self.bulk_min_seats = bulk_min_seats  # seats kept for bulk jobs: read them first while short of these
        self.retry_backoff = retry_backoff  # between the attempts of a job whose worker stopped (start_job.lua)
        # Look for lapsed leases a few times per lease: a dead worker's jobs wait at most ~1.25 leases.
        self.claim_every_s = min(max(lease_ms / 4000, 0.2), 10.0)
        self.stop_event = threading.Event()
        self._claim_cursors: dict[str, str] = {}  # queue -> where its next XAUTOCLAIM starts
        self._next_claim = 0.0
        self._recent_n = 1  # the largest n of recent jobs (halves back toward 1 after each read without one)

    def stop(self) -> None:
        self.stop_event.set()
        self.budget.wake()

    def run(self) -> None:
        backoff = Backoff("intake", self.stop_event, max_s=2.0)
        while not self.stop_event.is_set():
            allowance = self.budget.wait(timeout=0.5)
            if allowance <= 0 or self.stop_event.is_set():
                continue
            try:
                # n > 1 jobs take n seats each, known only once read: while recent jobs had n > 1, read
                # fewer at a time, so one read does not take allowance x n seats
                entries = self._read(max(1, allowance // self._recent_n))
                for entry in entries:
                    self._admit_one(entry, backoff)
                backoff.succeeded()
            except REDIS_DOWN as err:
                backoff.failed(err)
            except Exception:  # a bug in one entry's handling must not end intake for good
                log.exception("intake_error")
                self.stop_event.wait(1.0)

    def _read(self, allowance: int) -> list[Entry]:
        entries: list[Entry] = []
        now = time.monotonic()
        if now >= self._next_claim:
            complete, entries = self.jobs.claim_lapsed(self.lease_ms, allowance, self._claim_cursors)
            if complete:  # scanned every queue's whole pending list: rest until the next round
                self._next_claim = now + self.claim_every_s
            for e in entries:
                e.reclaimed = True
        if len(entries) < allowance:
            # Blocking here holds up only this thread; the engine keeps stepping.
            block = BLOCK_MS if not entries else None
            entries += self.jobs.read_new(allowance - len(entries), block, self._bulk_short())
        return entries

    def _bulk_short(self) -> int:
        """How many more bulk jobs this worker should hold to fill the seats kept for them (0 without)."""
        if not self.bulk_min_seats:
            return 0
        held = sum(1 for p in self.leases.priorities() if p == Priority.bulk)
        return max(0, self.bulk_min_seats - held)

    # ---- one entry ----------------------------------------------------------------------------------

    def _admit_one(self, entry: Entry, backoff: Backoff) -> None:
        """Admit one entry; whatever goes wrong with it ends it alone, never the rest of the read."""
        try:
            self._admit(entry, backoff)
        except REDIS_DOWN:
            raise
        except Exception as err:
            log.exception("entry_error", entry_id=entry.entry_id, job_id=entry.fields.get("job_id"))
            reason = f"malformed entry: the worker could not process it ({type(err).__name__}: {err})"
            self._reject(entry, entry.fields.get("job_id", ""), reason, backoff)

    def _reject(self, entry: Entry, job_id: str, reason: str, backoff: Backoff) -> None:
        """Dead-letter an entry that cannot run; a job record it names ends failed (status, TTL, event)."""
        raw = entry.fields.get("request", "")
        if job_id and self._retry(backoff, lambda: self.jobs.has_record(job_id)) \
                and self.leases.entry_of(job_id) is None:
            log.warning("job_rejected", job_id=job_id, entry_id=entry.entry_id, reason=reason)
            self.writer.end(Ending(job_id, entry.entry_id, "failed", error=reason,
                                   error_code=ErrorCode.invalid_request, queue=entry.queue),
                            dead=DeadLetter(job_id, reason, 0, raw))
            return
        log.warning("entry_dropped", entry_id=entry.entry_id, reason=reason)
        self._retry(backoff, lambda: self._drop(entry, job_id, reason, raw))

    def _admit(self, entry: Entry, backoff: Backoff) -> None:
        job_id = entry.fields.get("job_id", "")
        raw = entry.fields.get("request", "")
        if not is_valid_id(job_id):
            reason = f"malformed entry: job_id {job_id[:210]!r} missing or invalid (fields: {sorted(entry.fields)})"
            self._reject(entry, job_id, reason, backoff)
            return
        held = self.leases.entry_of(job_id)
        if held is not None:
            if held != entry.entry_id:
                # A second entry for a job running here (a manual re-XADD): the running one answers it.
                log.warning("entry_duplicate", job_id=job_id, entry_id=entry.entry_id, running_entry=held)
                self._retry(backoff, lambda: self.jobs.drop_entry(entry.entry_id, entry.queue))
            # else: our own entry, reclaimed by our XAUTOCLAIM after an outage outlived the lease: keep going
            return
        if entry.reclaimed:
            log.info("entry_reclaimed", job_id=job_id, entry_id=entry.entry_id)
        try:
            if entry.not_utf8:
                raise InvalidJob(f"invalid job: the entry's {', '.join(entry.not_utf8)} field is not valid "
                                 "UTF-8; send the request as UTF-8 JSON text")
            request, params = self._validate(raw, entry.queue)
        except InvalidJob as err:
            code = ErrorCode.model_mismatch if isinstance(err, ModelMismatch) else ErrorCode.invalid_request
            self._fail(entry, job_id, str(err), code, raw)
            return
        status, attempts = self._retry(backoff, lambda: self.jobs.start(
            job_id, entry.entry_id, entry.queue, self.retry_backoff, self.lease_ms))
        if status == "deferred":  # a retry after a transient fault, not due yet: claimed again when it is
            log.info("job_retry_deferred", job_id=job_id, entry_id=entry.entry_id, due_in_ms=attempts)
            return
        if status != "running":
            # Ended while queued (cancelled) or no record (expired, never submitted): the script acked it.
            log.info("job_skipped", job_id=job_id, entry_id=entry.entry_id, status=status)
            if status == "missing":
                self._retry(backoff, lambda: self.jobs.dead_letter_now(
                    DeadLetter(job_id, "no job record (expired or never submitted)", 0, raw)))
            return
        if attempts > self.max_attempts:
            reason = (f"gave up after {attempts - 1} attempts: every worker that ran this job stopped "
                      f"before finishing it (max_attempts={self.max_attempts})")
            log.error("job_dead_lettered", job_id=job_id, attempts=attempts - 1)
            self.writer.end(
                Ending(job_id, entry.entry_id, "failed", error=reason, error_code=ErrorCode.max_attempts,
                       queue=entry.queue),
                dead=DeadLetter(job_id, reason, attempts - 1, raw),
            )
            return
        self.leases.add(job_id, entry.entry_id, entry.queue, request.priority)
        job = StartedJob(job_id, entry.entry_id, request, params, attempts, time.time(),
                         stream=request.stream and self.stream_tokens, queue=entry.queue,
                         priority=request.priority,
                         model=self._model_of(entry.queue) or (self.served.id if self.served else ""))
        self.budget.sent(request.seats)  # each of its n choices (or embedding inputs) takes a seat
        self._recent_n = max(request.seats, (self._recent_n + 1) // 2)
        self.engine_inbox.put(job)
        log.info("job_started", job_id=job_id, entry_id=entry.entry_id, attempt=attempts)

    def _model_of(self, queue: str) -> str | None:
        return self.served.model_of_queue(queue) if self.served is not None else None

    def _validate(self, raw: str, queue: str = "") -> tuple[JobRequest, SamplingParams]:
        request = parse_request(raw)
        # on its model's queue the submit checked the name; on the default queues it may name any model
        if self._model_of(queue) is None and request.model is not None and request.model not in self.model_names:
            serves = self.served.id if self.served is not None else sorted(self.model_names)[0]
            raise ModelMismatch(f"this job asks for model {request.model!r}; this worker serves {serves!r}")
        return request, SamplingParams.of(request)

    def _fail(self, entry: Entry, job_id: str, reason: str, code: str, raw: str) -> None:
        log.warning("job_rejected", job_id=job_id, entry_id=entry.entry_id, reason=reason)
        self.writer.end(Ending(job_id, entry.entry_id, "failed", error=reason, error_code=code, queue=entry.queue),
                        orphan=DeadLetter(job_id, reason, 0, raw))

    def _drop(self, entry: Entry, job_id: str, reason: str, raw: str) -> None:
        self.jobs.drop_entry(entry.entry_id, entry.queue, dead=DeadLetter(job_id, reason, 0, raw))

    def _retry(self, backoff: Backoff, op):
        """Run one Redis write until it goes through: a job read from the stream is never just dropped."""
        while True:
            try:
                return op()
            except REDIS_DOWN as err:
                if self.stop_event.is_set():
                    raise  # the entry stays pending; its lease lapses and a worker reclaims it
                backoff.failed(err)
