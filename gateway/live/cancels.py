"""Canceller: the jobs of clients that went away (or timed out) are cancelled by one thread, on its own Redis
connection, and what the request held for them is given back only once each job has really ended.

A cancel from the request's own task used the shared pool, and under a stream flood it failed on the
exhausted pool: 112-120 abandoned jobs stayed queued (issue #22). Here a cancel is queued in memory (never
fails, never waits) and the thread retries each one with backoff until Redis takes it, for up to GIVE_UP_S.
A job running on a worker is only `cancelling` after the cancel: its `then` (the key's slot back, issue #34)
runs when the thread sees its record end, polled every ENDING_POLL_S for all such jobs in one pipeline.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable

import redis
import structlog

from gateway.live.background import Background
from protocol import scripts
from protocol.connection import redis_from_url
from protocol.jobs import TERMINAL_STATUSES
from protocol.keys import Keys
from protocol.models import DEFAULT_RESULT_TTL

log = structlog.get_logger("tokenbus.gateway")
GIVE_UP_S = 600.0
ENDING_POLL_S = 0.5
_ENDED = {s.value for s in TERMINAL_STATUSES} | {""}  # "": the record is gone, so nothing runs any more
Then = Callable[[], None]


class Canceller(Background):
    thread_name = "canceller"

    def __init__(self, redis_url: str, keys: Keys) -> None:
        self.redis = redis_from_url(redis_url, decode_responses=True, socket_timeout=10,
                                          socket_connect_timeout=5, max_connections=2)
        self.keys = keys
        self.result_ttl: int | None = None  # the namespace's, read on first use (as Client does)
        self._todo: queue.Queue[tuple[str, float, Then | None] | None] = queue.Queue()
        self._ending: dict[str, tuple[float, Then]] = {}  # cancelled while running: job id -> (since, then)
        self.done = 0  # cancels Redis took (tests, logs)
        super().__init__()

    def _interrupt(self) -> None:
        self._todo.put(None)

    def _close(self) -> None:
        self.redis.close()

    def cancel(self, job_id: str, then: Then | None = None) -> None:
        """Queue the cancel of a job nobody waits for any more (thread-safe, returns at once); `then` runs on
        this thread once the job has ended (at once when it was queued, or after GIVE_UP_S at the latest)."""
        self.start()
        self._todo.put((job_id, time.monotonic(), then))

    def _run(self) -> None:
        while True:
            try:
                item = self._todo.get(timeout=ENDING_POLL_S if self._ending else None)
            except queue.Empty:
                item = ()
            if item is None:
                return
            if item:
                self._cancel(*item)
            if self._ending:
                self._poll_ending()

    def _cancel(self, job_id: str, since: float, then: Then | None) -> None:
        delay = 0.1
        while True:
            try:
                if self.result_ttl is None:
                    self.result_ttl = int(self.redis.hget(self.keys.config, "result_ttl") or DEFAULT_RESULT_TTL)
                status = scripts.cancel_job(self.redis, self.keys, job_id, result_ttl=self.result_ttl)
                self.done += 1
                log.info("gateway_job_abandoned", job_id=job_id, status=status or "missing")
                break
            except redis.RedisError as err:
                if time.monotonic() - since > GIVE_UP_S:
                    log.error("gateway_cancel_gave_up", job_id=job_id, error=str(err))
                    status = ""
                    break
                log.warning("gateway_cancel_retry", job_id=job_id, error=str(err), retry_in_s=delay)
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
        if then is None:
            return
        if status in _ENDED:
            _call(then)
        else:  # running on a worker: its slot is given back when the worker has stopped it
            self._ending[job_id] = (since, then)

    def _poll_ending(self) -> None:
        ids = list(self._ending)
        try:
            pipe = self.redis.pipeline(transaction=False)
            for job_id in ids:
                pipe.hget(self.keys.job(job_id), "status")
            statuses = pipe.execute()
        except redis.RedisError as err:  # the next poll may get through; the key's lease lapses anyway
            log.warning("gateway_cancel_poll_failed", jobs=len(ids), error=str(err))
            return
        now = time.monotonic()
        for job_id, status in zip(ids, statuses, strict=True):
            since, then = self._ending[job_id]
            if (status or "") in _ENDED or now - since > GIVE_UP_S:  # None: the record is gone
                del self._ending[job_id]
                _call(then)


def _call(then: Then) -> None:
    try:
        then()
    except Exception:  # a callback's bug must not stop the cancels of everyone else
        log.exception("gateway_cancel_callback_failed")
