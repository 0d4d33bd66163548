"""Who notices that a batch has ended: a thread of `tokenbus-gateway tasks` watching {ns}:events.

Every job's end is an entry in {ns}:events (written by the same Lua that counts it in its batch). The
watcher blocks on that stream; when entries arrive it checks the open batches those jobs belong to (a batch
job's id is `{batch_id}-{i}`), and every watch_interval_s it checks all open batches anyway, since events
are trimmed and this process may have been down. A batch whose producer record has ended gets its
finalisation queued (once: enqueue_finalize); one past its completion window is cancelled and ends as
`expired` with what finished. The full check also sweeps batches stuck in `validating` (ingest.py), and
forgets ended batches past their retention (retention.py).
Several tasks processes may watch at once: the HSETNX guards and leases make each action happen once.
"""

from __future__ import annotations

import threading
import time

import redis
import structlog

from gateway.batches import ingest, retention
from gateway.context import GatewayContext
from gateway.enqueue import enqueue_finalize
from producer import batches
from protocol.models import TERMINAL_BATCH_STATUSES

log = structlog.get_logger("tokenbus.gateway")
MIN_GAP_S = 0.2  # under a flood of events, check a few times a second at most


class BatchWatcher:
    def __init__(self, ctx: GatewayContext, interval_s: float) -> None:
        self.ctx, self.interval_s = ctx, interval_s
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self.run, name="batch-watcher", daemon=True)

    def start(self) -> BatchWatcher:
        self.thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self.stop_event.set()
        self.thread.join(timeout)

    def run(self) -> None:
        ctx = self.ctx
        last_id = "$"
        next_full = 0.0
        while not self.stop_event.is_set():
            try:
                if last_id == "$":
                    last_id = ctx.client.events_last_id()
                resp = ctx.redis.xread({ctx.keys.events: last_id}, count=10_000,
                                       block=max(1, int(ctx.client.max_block_s * 1000)))
                ended_jobs = []
                for _stream, entries in resp or []:
                    last_id = entries[-1][0]
                    ended_jobs.extend(fields.get("job_id", "") for _id, fields in entries)
                if time.monotonic() >= next_full:
                    self.check(None)
                    ingest.sweep_validating(ctx)  # cancelled, expired, or whose submit died: end them
                    ctx.files.sweep_expired()  # output files past their batch's output_expires_after
                    retention.sweep(ctx)  # ended batches past batch_retention_s: their records and entries
                    next_full = time.monotonic() + self.interval_s
                elif ended_jobs:
                    self.check({jid.rsplit("-", 1)[0] for jid in ended_jobs if "-" in jid})
                    self.stop_event.wait(MIN_GAP_S)
            except redis.RedisError as err:
                log.warning("watcher_redis_error", error=str(err))
                self.stop_event.wait(1.0)
            except Exception:  # a bug must not stop finalisation for good: log it and go on
                log.exception("watcher_error")
                self.stop_event.wait(1.0)

    def check(self, candidates: set[str] | None) -> int:
        """Queue finalisation for ended open batches (all of them, or the candidates); returns how many."""
        ctx = self.ctx
        open_ids = ctx.redis.smembers(ctx.gkeys.open_batches)
        ids = sorted(open_ids if candidates is None else open_ids & candidates)
        if not ids:
            return 0
        pipe = ctx.redis.pipeline(transaction=False)
        for bid in ids:
            pipe.hget(ctx.keys.batch(bid), "status")
            pipe.hmget(ctx.gkeys.batch(bid), "final_status", "expires_at", "expire_requested_at")
        replies = pipe.execute()
        queued, now = 0, time.time()
        for i, bid in enumerate(ids):
            core_status, (final, expires_at, expire_requested) = replies[2 * i], replies[2 * i + 1]
            if final:
                ctx.redis.srem(ctx.gkeys.open_batches, bid)
            elif core_status in TERMINAL_BATCH_STATUSES:
                queued += enqueue_finalize(ctx, bid)
            elif core_status and expires_at and now > float(expires_at) and not expire_requested:
                if ctx.redis.hsetnx(ctx.gkeys.batch(bid), "expire_requested_at", now):
                    log.info("gateway_batch_expiring", batch_id=bid)
                    batches.cancel_batch(ctx.client, bid)
        if queued:
            log.info("gateway_batches_ended", finalizations_queued=queued)
        return queued
