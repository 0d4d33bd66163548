"""Every batch reaches a terminal state: the submit lease, ending a batch that never ran, undoing a failed ingest,
and the watcher's sweep of batches stuck in `validating`.

A submit holds a lease ({ns}:gw:submit-lease:{batch}, renewed by a thread while it writes). A cancel, an
expiry or the sweep may end a validating batch only after taking that same lease, so exactly one of them
acts. A lease that lapses means its process died: the sweep then fails the batch. A submit that hits
QueueFull or Redis OOM removes the jobs it wrote that have not started (freeing their memory first, with
commands Redis allows when full), cancels the rest and ends the batch `failed` with the reason.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import redis
import structlog
from rq.job import Job as RQJob

from gateway.batches import capacity
from gateway.batches.records import GatewayBatch, load_core
from gateway.context import GatewayContext
from gateway.enqueue import enqueue_submit, enqueue_webhook
from producer import batches
from protocol.errors import BatchNotFound
from protocol.scripts import CHUNK, lua, script

log = structlog.get_logger("tokenbus.gateway")

# Deletes the job records still queued (never started): protocol/lua/drop_queued.lua
_DROP_QUEUED = lua("drop_queued")
MAX_REQUEUES = 3
OOM_RETRIES = (0.2, 0.5, 1.0, 2.0, 4.0)  # seconds between tries of writes refused while Redis is full


class SubmitLease:
    """A lease on acting on one validating batch, renewed by a thread while held."""

    def __init__(self, ctx: GatewayContext, batch_id: str, holder: str) -> None:
        self.ctx, self.key, self.holder = ctx, ctx.gkeys.submit_lease(batch_id), holder
        self.batch_key = ctx.gkeys.batch(batch_id)
        self.ms = int(ctx.settings.submit_lease_s * 1000)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> bool:
        if not self.ctx.redis.set(self.key, self.holder, nx=True, px=self.ms):
            return False
        # someone acts on the batch now: a sweep's earlier sighting of it without a live submit no longer counts
        self.ctx.redis.hdel(self.batch_key, "submit_lost_at")
        self._thread = threading.Thread(target=self._renew, name="submit-lease", daemon=True)
        self._thread.start()
        return True

    def _renew(self) -> None:
        while not self._stop.wait(self.ms / 3000):
            try:
                # a renewal starved past the lease (a loaded machine) finds the key gone: take it again
                if not self.ctx.redis.pexpire(self.key, self.ms) and \
                        not self.ctx.redis.set(self.key, self.holder, nx=True, px=self.ms):
                    log.warning("submit_lease_lost", key=self.key, holder=self.ctx.redis.get(self.key))
            except redis.RedisError as err:  # the next renewal may get through; the lease lasts self.ms
                log.warning("submit_lease_renew_failed", key=self.key, error=str(err))

    def release(self, keep: bool = False) -> None:
        """Stop renewing; keep=True leaves the key to lapse (the batch has ended: nobody needs it sooner)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        if not keep:
            self.ctx.redis.delete(self.key)


def retry_oom(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """fn(*args) retried with backoff while Redis refuses writes for lack of memory (bounded)."""
    for pause in (*OOM_RETRIES, None):
        try:
            return fn(*args, **kwargs)
        except redis.exceptions.OutOfMemoryError:
            if pause is None:
                raise
            time.sleep(pause)
    return None


def end_without_jobs(ctx: GatewayContext, gw: GatewayBatch, status: str, errors: list[dict]) -> None:
    """End a batch that will run no (more) jobs: final status, errors, counts; free its reservation; webhook."""
    core = load_core(ctx.redis, ctx.keys, gw.id)
    gw.final_status, gw.ended_at, gw.errors = status, time.time(), errors or None
    gw.completed = core.finished if core else 0
    gw.failed = (core.failed + core.cancelled) if core else 0
    pipe = ctx.redis.pipeline(transaction=True)
    pipe.hset(ctx.gkeys.batch(gw.id), mapping=gw.fields("final_status", "ended_at", "errors", "completed", "failed"))
    pipe.srem(ctx.gkeys.open_batches, gw.id)
    pipe.srem(ctx.gkeys.validating, gw.id)
    retry_oom(pipe.execute)
    capacity.release(ctx, gw.id, gw.owner)
    log.info("gateway_batch_ended", batch_id=gw.id, status=status, errors=len(errors))
    enqueue_webhook(ctx, gw)


def drop_ingested(ctx: GatewayContext, batch_id: str) -> int:
    """Undo a partial ingest: delete the jobs not yet started, then cancel the batch (the running ones stop,
    the deleted ones count as cancelled). Returns how many were deleted."""
    drop, dropped = script(_DROP_QUEUED), 0
    for ids in batches.iter_batch_job_ids(ctx.client, batch_id, CHUNK):
        dropped += int(drop(keys=[ctx.keys.job(j) for j in ids], args=[], client=ctx.redis))
    # The batch's own stream: its entries (each a copy of its request) go too. XTRIM, like DEL, is allowed
    # when Redis is full; the stream and its group stay, so a worker reading it sees an empty queue.
    if queue := ctx.redis.hget(ctx.keys.batch(batch_id), "queue"):
        ctx.redis.xtrim(queue, maxlen=0)
    try:
        retry_oom(batches.cancel_batch, ctx.client, batch_id)
    except BatchNotFound:
        pass
    return dropped


def fail_ingest(ctx: GatewayContext, gw: GatewayBatch, code: str, message: str) -> None:
    """The submit could not write every job: remove what it wrote, end the batch failed (cancelled if asked)."""
    dropped = drop_ingested(ctx, gw.id) if load_core(ctx.redis, ctx.keys, gw.id) else 0
    log.warning("gateway_batch_ingest_failed", batch_id=gw.id, code=code, jobs_removed=dropped, error=message)
    fresh = GatewayBatch.load(ctx.redis, ctx.gkeys, gw.id) or gw
    if fresh.cancel_requested_at:
        end_without_jobs(ctx, fresh, "cancelled", [])
    else:
        end_without_jobs(ctx, fresh, "failed", [{"code": code, "message": message, "param": None, "line": None}])


def sweep_validating(ctx: GatewayContext) -> int:
    """End the validating batches nobody will submit: cancelled, expired, or whose submit died or gave up."""
    ended = 0
    for bid in sorted(ctx.redis.smembers(ctx.gkeys.validating)):
        gw = GatewayBatch.load(ctx.redis, ctx.gkeys, bid)
        if gw is None or gw.final_status or gw.submitted_at:
            ctx.redis.srem(ctx.gkeys.validating, bid)
            continue
        if ctx.redis.exists(ctx.gkeys.submit_lease(bid)):
            continue  # a submit is writing it now
        verdict = _verdict(ctx, gw)
        if verdict is None:
            continue
        if end_unsubmitted(ctx, bid, "sweep", *verdict):
            ended += 1
    return ended


def end_unsubmitted(ctx: GatewayContext, batch_id: str, holder: str, status: str, errors: list[dict]) -> bool:
    """End a validating batch that nobody is submitting as `status`, under its submit lease (so a submit, a cancel
    and the sweep never both act), whatever happened to its submit task (queued behind others, failed, its
    process killed part-way: the jobs it wrote are dropped). False when another holds the lease, or the batch
    was submitted or ended meanwhile."""
    lease = SubmitLease(ctx, batch_id, holder)
    if not lease.acquire():
        return False
    try:
        gw = GatewayBatch.load(ctx.redis, ctx.gkeys, batch_id)
        if gw is None or gw.final_status or gw.submitted_at:
            return False
        if load_core(ctx.redis, ctx.keys, batch_id) is not None:  # a submit died part-way
            drop_ingested(ctx, batch_id)
        end_without_jobs(ctx, gw, status, errors)
        return True
    finally:
        lease.release(keep=True)  # the batch has ended (or was never ours to end): let the key lapse


def _lost_for_a_lease(ctx: GatewayContext, gw: GatewayBatch) -> bool:
    """Whether the sweep has seen this batch without a live submit task for a lease's length (the first
    sighting is kept in its record): one sighting is a race, not a verdict."""
    key, now = ctx.gkeys.batch(gw.id), time.time()
    if ctx.redis.hsetnx(key, "submit_lost_at", now):
        return False
    return now - float(ctx.redis.hget(key, "submit_lost_at") or now) >= ctx.settings.submit_lease_s


def _verdict(ctx: GatewayContext, gw: GatewayBatch) -> tuple[str, list[dict]] | None:
    """(status, errors) for a validating batch without a live submit, or None to leave it be."""
    if gw.cancel_requested_at:
        return "cancelled", []
    if time.time() > gw.expires_at:
        return "expired", []
    try:
        job = RQJob.fetch(f"submit-{gw.id}", connection=ctx.rq_redis)
        status = job.get_status(refresh=False)
    except Exception:  # no such job: not queued yet, or it expired or was deleted
        job, status = None, None
    state = getattr(status, "value", status)
    if (job is None or state == "started") and not _lost_for_a_lease(ctx, gw):
        # One sighting is a race: a batch joins `validating` (capacity.admit) a round trip before its submit task
        # is queued (service.py), and a started submit may not hold its lease yet (or its renewal was starved)
        return None
    if state == "queued" and job is not None and job.get_position() is None:
        # Popped by a worker that died or could not record its start (Redis refusing writes): lost. (A worker
        # marks it started right after popping it: only a job seen lost for a lease's length counts.) The
        # submit is idempotent, so queue it again, a few times at most.
        if not _lost_for_a_lease(ctx, gw):
            return None
        key = ctx.gkeys.batch(gw.id)
        ctx.redis.hdel(key, "submit_lost_at")
        if ctx.redis.hincrby(key, "submit_requeues", 1) <= MAX_REQUEUES:
            log.warning("gateway_submit_requeued", batch_id=gw.id)
            enqueue_submit(ctx, gw.id)
            return None
        state = "lost"
    elif state in ("queued", "scheduled", "deferred"):
        return None  # waiting for a tasks process (retries included)
    if state == "finished":
        return None  # it ended the batch itself (the next sweep sees that)
    why = {"failed": "the submit task failed after its retries", "started": "the process submitting it died",
           None: "its submit task is gone", "lost": "its submit task was lost several times"}.get(
        state, f"its submit task is {state}")
    detail = ""
    if job is not None and state == "failed":
        detail = ": " + (job.latest_result().exc_string.strip().splitlines() or [""])[-1][:300] \
            if job.latest_result() else ""
    return "failed", [{"code": "submit_failed", "param": None, "line": None,
                       "message": f"the batch could not be queued: {why}{detail}; create it again"}]
