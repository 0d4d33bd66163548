"""JobWaiter: many HTTP requests wait on their jobs through one thread reading {ns}:events.

A blocking wait per request (Client.wait in a thread) would hold a thread and a Redis connection each, so
the number of concurrent /v1/chat/completions calls would be the thread pool's size. Here one thread XREADs
the events stream for all of them and wakes each request's future when its job ends; every RESYNC_S it
re-reads the records of all waiting jobs too, since events are trimmed.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable

import redis
import structlog
from starlette.concurrency import run_in_threadpool

from gateway.live.background import Background
from producer.client import Client
from protocol.errors import JobNotFound
from protocol.models import Job

log = structlog.get_logger("tokenbus.gateway")
RESYNC_S = 5.0
POLL_DISCONNECT_S = 1.0


class ClientGone(Exception):
    """The HTTP client disconnected while waiting."""


class JobWaiter(Background):
    thread_name = "job-waiter"

    def __init__(self, client: Client) -> None:
        self.client = client
        self._waiting: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Future]]] = {}
        self._lock = threading.Lock()
        super().__init__()

    async def wait(self, job_id: str, timeout: float,
                   disconnected: Callable[[], Awaitable[bool]] | None = None) -> Job | None:
        """The ended job, or None after `timeout` s; ClientGone if `disconnected()` turns true meanwhile."""
        self.start()
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        with self._lock:
            self._waiting.setdefault(job_id, []).append((loop, fut))
        try:
            # Read once after registering: a job that ended before that sent its event already.
            job = (await run_in_threadpool(self.client.get_many, [job_id]))[0]
            if job is None:
                raise JobNotFound(f"job {job_id} has no record")
            if job.done:
                return job
            deadline = time.monotonic() + timeout
            while (left := deadline - time.monotonic()) > 0:
                try:
                    return await asyncio.wait_for(asyncio.shield(fut), min(left, POLL_DISCONNECT_S))
                except TimeoutError:
                    if disconnected is not None and await disconnected():
                        raise ClientGone(job_id) from None
            return None
        finally:
            with self._lock:
                entries = [e for e in self._waiting.get(job_id, []) if e[1] is not fut]
                if entries:
                    self._waiting[job_id] = entries
                else:
                    self._waiting.pop(job_id, None)

    def _run(self) -> None:
        r, events = self.client.redis, self.client.keys.events
        last_id, next_resync = None, time.monotonic() + RESYNC_S
        while not self._stop.is_set():
            try:
                if last_id is None:
                    last_id = self.client.events_last_id()
                resp = r.xread({events: last_id}, count=10_000, block=max(1, int(self.client.max_block_s * 1000)))
                with self._lock:
                    waiting = set(self._waiting)
                ended = set()
                for _stream, entries in resp or []:
                    last_id = entries[-1][0]
                    ended.update(f.get("job_id") for _id, f in entries if f.get("job_id") in waiting)
                if time.monotonic() >= next_resync:
                    ended, next_resync = waiting, time.monotonic() + RESYNC_S
                if ended:
                    self._wake([j for j in self.client.get_many(sorted(ended)) if j is not None and j.done])
            except redis.RedisError as err:
                log.warning("waiter_redis_error", error=str(err))
                self._stop.wait(1.0)
            except Exception:  # keep waking requests whatever one read did
                log.exception("waiter_error")
                self._stop.wait(1.0)

    def _wake(self, jobs: list[Job]) -> None:
        with self._lock:
            targets = [(loop, fut, job) for job in jobs for loop, fut in self._waiting.get(job.id, [])]
        for loop, fut, job in targets:
            loop.call_soon_threadsafe(_resolve, fut, job)


def _resolve(fut: asyncio.Future, job: Job) -> None:
    if not fut.done():
        fut.set_result(job)
