"""The serve loop: the engine steps in this (main) thread; Redis I/O lives in three helper threads.

    Intake ──StartedJob──▶ inbox ──▶ Server.run: add_request / abort / step ──▶ CompletionWriter ──▶ Redis
    Housekeeper (leases, cancels, heartbeat) ──Revoke──▶ inbox

The loop never touches Redis itself, so an outage or a slow round trip never delays a forward pass: while
Redis is away the engine finishes what it holds and the writer keeps the endings until Redis is back.
"""

from __future__ import annotations

import queue
import signal
import threading
import time
from typing import Any

import structlog

from protocol.errors import TokenbusError
from protocol.models import ErrorCode, JobResult
from protocol.registry import short_name
from protocol.scripts import RetryBackoff
from worker.engine.config import bulk_min_seats
from worker.engine.errors import EngineError, InvalidRequest
from worker.serve.adapters import AdapterChange, ServedAdapters
from worker.serve.backoff import REDIS_DOWN, Backoff
from worker.serve.completion import CompletionWriter, FirstToken
from worker.serve.embed_jobs import EmbedJobs, job_of
from worker.serve.intake import BLOCK_MS, Intake, IntakeBudget
from worker.serve.isolation import FaultIsolation
from worker.serve.job_queue import Ending, JobQueue
from worker.serve.leases import Housekeeper, Leases
from worker.serve.messages import HandBack, Partial, Revoke, StartedJob, Wake
from worker.serve.results import job_result
from worker.serve.served import ServedModels
from worker.serve.status import EngineStatus
from worker.settings import WorkerSettings, lora_flags

log = structlog.get_logger("tokenbus.worker")

IDLE_WAIT_S = 0.2  # how long an idle loop waits for a message before it beats the health check
REVOKE_MEMORY_S = 300.0  # how long a revoke for a job not yet in the engine is remembered


class Server(FaultIsolation):
    def __init__(self, settings: WorkerSettings, engine: Any, client: Any,
                 metrics: Any | None = None) -> None:
        self.settings = settings
        self.engine = engine
        self.metrics = metrics
        self.jobs = JobQueue(client, settings.namespace, settings.worker_name, settings.result_ttl_s,
                             min_replicas=settings.redis_min_replicas, wait_ms=settings.redis_wait_ms)
        self.leases = Leases()
        self.inbox: queue.Queue = queue.Queue()
        # the engine's max_num_seqs (the setting, or the device's default when unset); a smaller setting than
        # the engine was built with caps the seats this worker takes
        seats = min(engine.max_num_seqs, settings.engine.max_num_seqs or engine.max_num_seqs)
        self.capacity = seats + settings.intake_lookahead
        # never more than `capacity` jobs leased here, however far behind the writer is
        self.budget = IntakeBudget(self._room(0, 0), leases=self.leases, limit=self.capacity)
        self.leases.on_release = self.budget.wake

        self.writer = CompletionWriter(self.jobs, self.leases, metrics=metrics)
        self.served = ServedModels(
            self.jobs.keys, settings.worker_name, settings.engine.model, short_name(engine.model_name),
            getattr(engine, "checkpoint", ""), settings.served_model_name, engine.max_model_len,
            kinds=list(getattr(engine, "kinds", ["generate"])), root=settings.engine.model)
        self.adapters = ServedAdapters(self.jobs.keys, self.served, lora_flags(settings.lora))
        self.intake = Intake(
            self.jobs, self.leases, self.budget, self.inbox, self.writer,
            model_names=self.served.names, lease_ms=settings.lease_ms,
            max_attempts=settings.max_attempts, stream_tokens=settings.stream_tokens,
            bulk_min_seats=bulk_min_seats(settings.engine.bulk_min_fraction, seats), served=self.served,
            retry_backoff=RetryBackoff(settings.retry_backoff_ms, settings.retry_backoff_max_ms)
            if settings.retry_backoff_ms else None,
        )
        self.housekeeper = Housekeeper(
            self.jobs, self.leases, self.inbox, settings.lease_ms, settings.heartbeat_s, self._status, metrics,
            served=self.served, adapters=self.adapters,
        )
        self.running: dict[str, StartedJob] = {}  # jobs inside the engine
        self.embeds = EmbedJobs()  # the embedding jobs among them: one engine request per input
        self._init_isolation()  # suspects, isolating, held, step_failures (isolation.py)
        self.revoked: dict[str, tuple[str, float]] = {}  # job -> (reason, when) for jobs not yet seen here
        self.stop_requested = threading.Event()
        self.drain_deadline: float | None = None
        self.exit_code = 0
        self.status = EngineStatus(engine)  # the heartbeat's engine numbers

    # ---- lifecycle ----------------------------------------------------------------------------------

    def request_stop(self, why: str = "") -> None:
        """Begin the drain (thread-safe; a second call ends the grace period at once)."""
        if self.stop_requested.is_set():
            self.drain_deadline = time.monotonic()
        self.stop_requested.set()
        self.inbox.put(Wake(why))

    def install_signal_handlers(self) -> None:
        def handler(signum: int, _frame: Any) -> None:
            self.request_stop(signal.Signals(signum).name)

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    def run(self) -> int:
        try:
            if not self._connect():
                return 0
        except TokenbusError as err:  # a name of this worker's is another checkpoint's: an operator's to fix
            log.error("model_declaration_refused", model=self.served.record.id, error=str(err))
            return 2
        for t in (self.writer, self.housekeeper, self.intake):
            t.start()
        log.info("worker_ready", worker=self.jobs.consumer, model=self.served.id, serves=self.jobs.read_models,
                 namespace=self.settings.namespace, capacity=self.capacity)
        while True:
            self._take_messages(block=not self.engine.has_unfinished_requests())
            if self.stop_requested.is_set() and self.drain_deadline is None:
                self._begin_drain()
            self._seat_set_aside()
            if self.engine.has_unfinished_requests():
                self._step()
            if self.adapters.unloading:  # removed while requests used them: unloaded once those have ended
                self.adapters.apply(self.engine, None)
            stats = self.engine.stats()
            set_aside = len(self.suspects) + len(self.held)
            self.budget.set_room(self._room(stats.running, stats.waiting + stats.forking + set_aside))
            self._publish_stats(stats)
            if self.exit_code:
                break
            if self.drain_deadline is not None:
                idle = not (self.engine.has_unfinished_requests() or self.suspects or self.held
                            or not self.inbox.empty())
                if idle and not self.intake.is_alive():
                    break
                if time.monotonic() >= self.drain_deadline:
                    self._hand_back_all("drain grace period over", count_attempt=False)
                    break
        return self._shutdown()

    def _room(self, running: int, unseated: int) -> int:
        """Jobs intake may add: the capacity left, and with intake_max_waiting no more held without a seat than
        that (`unseated`: waiting for a seat or KV blocks, set aside, or choices waiting to fork, which take
        seats all the same), so a KV-bound worker leaves the backlog in the queue for the autoscaler to see."""
        room = self.capacity - running - unseated
        cap = self.settings.intake_max_waiting
        return room if cap is None else min(room, cap - unseated)

    def _connect(self) -> bool:
        backoff = Backoff("connecting", self.stop_requested)
        while not self.stop_requested.is_set():
            try:
                self.served.declare(self.jobs.r)
                self.adapters.start(self.engine, self.jobs.r)  # the threads are not running yet
                self.jobs.read_models = self.served.read_ids()
                self.jobs.ensure_group()
                self.jobs.publish_config(self.settings.queue_config())
                backoff.succeeded()
                return True
            except REDIS_DOWN as err:
                backoff.failed(err)
        return False

    def _begin_drain(self) -> None:
        self.drain_deadline = time.monotonic() + self.settings.drain_grace_s
        log.info("drain_started", running=len(self.running), grace_s=self.settings.drain_grace_s)
        self.intake.stop()

    def _shutdown(self) -> int:
        if self.drain_deadline is None:
            self.drain_deadline = time.monotonic()
        self.intake.stop()
        self.intake.join(timeout=BLOCK_MS / 1000 + 10)
        self._take_messages(block=False)  # jobs intake handed over while stopping go back (draining)
        self._hand_back_all("worker stopping", count_attempt=self.exit_code != 0)
        written = self.writer.close(timeout=max(5.0, self.settings.lease_ms / 1000))
        self.housekeeper.stop()
        self.housekeeper.join(timeout=5)
        try:
            self.jobs.sign_off()
        except REDIS_DOWN:
            pass
        log.info("worker_stopped", exit_code=self.exit_code, results_written=written,
                 jobs_done=self.writer.jobs_done)
        return self.exit_code

    def _publish_stats(self, stats: Any) -> None:
        """Heartbeat numbers and gauges after every turn of the loop (EngineStatus.refresh says why)."""
        self.status.refresh(stats)
        if self.metrics is not None:
            self.metrics.observe_engine(stats.running, stats.waiting, stats.used_blocks, stats.free_blocks)

    def _status(self) -> dict[str, Any]:
        return self.status.heartbeat(self.writer.jobs_done, draining=self.drain_deadline is not None) \
            | self.served.heartbeat_fields() | self.adapters.heartbeat_fields()

    # ---- messages -----------------------------------------------------------------------------------

    def _take_messages(self, block: bool) -> None:
        try:
            msg = self.inbox.get(timeout=IDLE_WAIT_S) if block else self.inbox.get_nowait()
        except queue.Empty:
            if block and self.metrics is not None:
                self.metrics.heartbeat()  # idle, not wedged: observe_step beats only while stepping
            return
        while True:
            self._handle(msg)
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, msg: Any) -> None:
        if isinstance(msg, StartedJob):
            self.budget.taken(msg.request.seats)
            self._add(msg)
        elif isinstance(msg, Revoke):
            self._revoke(msg)
        elif isinstance(msg, AdapterChange):
            self.adapters.apply(self.engine, msg)

    def _add(self, job: StartedJob) -> None:
        if self.drain_deadline is not None:
            self.writer.put(HandBack(job.job_id, job.entry_id, count_attempt=False, why="draining", queue=job.queue))
            return
        revoked = self.revoked.pop(job.job_id, None)
        if revoked is not None:
            self._drop_unseated(job, revoked[0])
            return
        if self.suspects or self.isolating is not None:
            self.held.append(job)
            return
        self._seat(job)

    def _seat(self, job: StartedJob) -> None:
        try:
            if job.request.kind == "embed":
                self.embeds.seat(self.engine, job)
            else:
                self.engine.add_request(job.job_id, job.request.engine_prompt(), job.params, priority=job.priority,
                                        lora=self.served.lora_of(job.model))
        except InvalidRequest as err:  # the client's to fix: prompt too long, can never fit the cache, ...
            self._end(job, "failed", error=f"invalid job: {err}", error_code=err.code)
            return
        except Exception as err:  # an EngineFault, or anything else: the worker's, never the request's
            log.exception("add_request_error", job_id=job.job_id)
            self._end(job, "failed", error=f"worker error: {type(err).__name__}: {err}",
                      error_code=ErrorCode.worker_error)
            return
        self.running[job.job_id] = job
        if self.metrics is not None:
            self.metrics.job_started()

    def _drop_unseated(self, job: StartedJob, reason: str) -> None:
        if reason == "cancel":
            self._end(job, "cancelled", error="cancelled before it ran", error_code=ErrorCode.cancelled)
        # "lost": another worker holds it now; nothing to write

    def _revoke(self, msg: Revoke) -> None:
        for waiting in (self.suspects, self.held):
            for job in list(waiting):
                if job.job_id == msg.job_id:
                    waiting.remove(job)
                    self._drop_unseated(job, msg.reason)
                    return
        job = self.running.pop(msg.job_id, None)
        if job is None:
            # Not in the engine yet (its StartedJob is still queued behind us) or ended already.
            now = time.monotonic()
            self.revoked = {k: v for k, v in self.revoked.items() if now - v[1] < REVOKE_MEMORY_S}
            self.revoked[msg.job_id] = (msg.reason, now)
            return
        if msg.job_id in self.embeds.groups:
            self._abort_quietly(msg.job_id)
            if msg.reason == "cancel":
                self._end(job, "cancelled", error="cancelled while running", error_code=ErrorCode.cancelled)
            return
        out = self.engine.abort(msg.job_id)  # frees its KV blocks now; it leaves the next step's batch
        if msg.reason == "cancel" and out is not None:
            self._end_with_output(job, out)
        else:
            log.info("job_dropped", job_id=msg.job_id, why="lease lost")

    # ---- stepping -----------------------------------------------------------------------------------

    def _step(self) -> None:
        started = time.perf_counter()
        try:
            finished = self.engine.step()
        except Exception as err:
            self._step_failed(err)
            return
        elapsed = time.perf_counter() - started
        self.status.step_took(elapsed)
        self.step_failures = 0
        stats = self.engine.stats()
        self.status.refresh(stats)
        if self.metrics is not None:
            self.metrics.observe_prefix_cache(stats.prefix_queried_tokens, stats.prefix_hit_tokens,
                                              stats.prefix_queried_blocks, stats.prefix_hit_blocks,
                                              stats.cached_blocks)
            self.metrics.observe_step(elapsed, stats.running, stats.waiting, stats.used_blocks,
                                      stats.free_blocks, stats.preemptions)
        now = time.time()
        for job_id, delta in self.engine.deltas.items():
            job = self.running.get(job_id)
            if job is None:
                continue
            if job.first_token_at is None:
                job.first_token_at = now
                self.writer.put(FirstToken(job_id, now))
            if job.stream:
                self.writer.put(Partial(job_id, delta.token_ids, job.published, delta.text))
                job.published += len(delta.token_ids)
                job.published_chars += len(delta.text)
        for out in finished:
            if out.embedding is not None:
                done = self.embeds.take(out)
                job = self.running.pop(done, None) if done is not None else None
                if job is not None:
                    self._end_embedding(job)
                continue
            job = self.running.pop(out.request_id, None)
            if job is not None:
                self._end_with_output(job, out)
        for request_id, err in self.engine.rejected.items():  # e.g. a grammar the engine could not compile
            job = self.running.pop(job_of(request_id), None)
            if job is not None:
                self._abort_quietly(job.job_id)
                self._fail(job, err)

    def _hand_back_all(self, why: str, count_attempt: bool) -> None:
        for job in list(self.running.values()):
            self._abort_quietly(job.job_id)
        for job in [*self.running.values(), *self.suspects, *self.held]:
            self.writer.put(HandBack(job.job_id, job.entry_id, count_attempt=count_attempt, why=why,
                                     queue=job.queue))
        self.running.clear()
        self.suspects.clear()
        self.held.clear()
        self.isolating = None

    def _abort_quietly(self, job_id: str) -> None:
        for request_id in self.embeds.engine_ids(job_id):
            try:
                self.engine.abort(request_id)
            except Exception:
                log.exception("abort_error", job_id=job_id)
        self.embeds.forget(job_id)

    # ---- endings ------------------------------------------------------------------------------------

    def _end_with_output(self, job: StartedJob, out: Any) -> None:
        if job.stream:
            # the done chunk carries what no delta did (an aborted job's last step), so the stream's tokens are the
            # result's (docs/protocol.md, "How a token stream ends")
            self.writer.put(Partial(job.job_id, out.token_ids[job.published:], job.published,
                                    out.text[job.published_chars:], done=True))
        cancelled = out.finish_reason == "abort"
        result = job_result(out, job.model or self.engine.model_name, self.engine.tokenizer)
        completion_tokens = result.usage.completion_tokens
        self._end(job, "cancelled" if cancelled else "finished", result=result,
                  error="cancelled while running" if cancelled else None,
                  error_code=ErrorCode.cancelled if cancelled else None,
                  finished_at=out.finish_time, finish_reason=out.finish_reason,
                  first_token_at=out.first_token_time, completion_tokens=completion_tokens)

    def _end_embedding(self, job: StartedJob) -> None:
        result, vectors = self.embeds.result(job.job_id, job.model or self.engine.model_name)
        self._end(job, "finished", result=result, vectors=vectors, finish_reason="stop")

    def _fail(self, job: StartedJob, err: EngineError) -> None:
        """A job the engine gave up on: the client's to fix (InvalidRequest, with its code) or the worker's."""
        if isinstance(err, InvalidRequest):
            self._end(job, "failed", error=f"invalid job: {err}", error_code=err.code)
        else:
            self._end(job, "failed", error=f"worker error: the engine failed on this job ({err})",
                      error_code=ErrorCode.worker_error)

    def _end(self, job: StartedJob, status: str, result: JobResult | None = None,
             error: str | None = None, error_code: str | None = None, finished_at: float | None = None,
             vectors: bytes = b"", **stats: Any) -> None:
        ending = Ending(job.job_id, job.entry_id, status, result=result, error=error, error_code=error_code,
                        finished_at=finished_at or time.time(), queue=job.queue, vectors=vectors)
        self.writer.end(ending, started_at=job.started_at, **stats)
