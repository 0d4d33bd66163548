"""Canceller: the jobs of clients that went away are cancelled by one thread, on its own Redis connection.

A cancel from the request's own task used the shared pool, and under a stream flood it failed on the
exhausted pool: 112-120 abandoned jobs stayed queued (issue #22). Here a cancel is queued in memory (never
fails, never waits) and the thread retries each one with backoff until Redis takes it, for up to GIVE_UP_S.
"""

from __future__ import annotations

import queue
import time

import redis
import structlog

from gateway.live.background import Background
from protocol import scripts
from protocol.connection import redis_from_url
from protocol.keys import Keys
from protocol.models import DEFAULT_RESULT_TTL

log = structlog.get_logger("tokenbus.gateway")
GIVE_UP_S = 600.0


class Canceller(Background):
    thread_name = "canceller"

    def __init__(self, redis_url: str, keys: Keys) -> None:
        self.redis = redis_from_url(redis_url, decode_responses=True, socket_timeout=10,
                                          socket_connect_timeout=5, max_connections=2)
        self.keys = keys
        self.result_ttl: int | None = None  # the namespace's, read on first use (as Client does)
        self._todo: queue.Queue[tuple[str, float] | None] = queue.Queue()
        self.done = 0  # cancels Redis took (tests, logs)
        super().__init__()

    def _interrupt(self) -> None:
        self._todo.put(None)

    def _close(self) -> None:
        self.redis.close()

    def cancel(self, job_id: str) -> None:
        """Queue the cancel of a job nobody waits for any more (thread-safe, returns at once)."""
        self.start()
        self._todo.put((job_id, time.monotonic()))

    def _run(self) -> None:
        delay = 0.1
        while (item := self._todo.get()) is not None:
            job_id, since = item
            while True:
                try:
                    if self.result_ttl is None:
                        self.result_ttl = int(self.redis.hget(self.keys.config, "result_ttl") or DEFAULT_RESULT_TTL)
                    status = scripts.cancel_job(self.redis, self.keys, job_id, result_ttl=self.result_ttl)
                    self.done += 1
                    log.info("gateway_job_abandoned", job_id=job_id, status=status or "missing")
                    delay = 0.1
                    break
                except redis.RedisError as err:
                    if time.monotonic() - since > GIVE_UP_S:
                        log.error("gateway_cancel_gave_up", job_id=job_id, error=str(err))
                        break
                    log.warning("gateway_cancel_retry", job_id=job_id, error=str(err), retry_in_s=delay)
                    time.sleep(delay)
                    delay = min(delay * 2, 5.0)
