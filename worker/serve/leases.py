"""Leases: the stream entries this worker holds, and the housekeeper thread that keeps them alive.

A lease is the entry's idle time in the consumer group's pending list. The housekeeper resets it every
lease_ms/3 for every entry held here; when this process dies the idle time grows past lease_ms and any
worker's XAUTOCLAIM takes the entry over. The same thread polls cancel requests and writes the heartbeat,
so none of that Redis traffic ever waits on (or holds up) a forward pass.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import structlog

from protocol.priority import Priority
from protocol.records import Heartbeat
from worker.serve.backoff import REDIS_DOWN, Backoff
from worker.serve.job_queue import JobQueue
from worker.serve.messages import Revoke

log = structlog.get_logger("tokenbus.worker")

CANCEL_POLL_S = 0.2
UNSERVED_LOG_EVERY_S = 60.0  # how often a model with jobs and no live worker is logged again


class Leases:
    """job id -> entry id (and its queue) of every job this worker has started and not yet ended or handed
    back."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[str, str] = {}
        self._queue: dict[str, str] = {}  # job id -> the stream its entry is in
        self._priority: dict[str, Priority] = {}  # job id -> its request's priority
        self.on_release: Callable[[], None] | None = None  # e.g. wake intake: room for one more job

    def add(self, job_id: str, entry_id: str, queue: str, priority: Priority = Priority.default) -> None:
        with self._lock:
            self._held[job_id] = entry_id
            self._queue[job_id] = queue
            self._priority[job_id] = Priority(priority)

    def release(self, job_id: str, entry_id: str | None = None) -> None:
        with self._lock:
            released = (entry_id is None or self._held.get(job_id) == entry_id) and job_id in self._held
            if released:
                self._held.pop(job_id, None)
                self._queue.pop(job_id, None)
                self._priority.pop(job_id, None)
        if released and self.on_release is not None:
            self.on_release()

    def queues(self) -> list[str]:
        """The queue of every job held (one per job)."""
        with self._lock:
            return list(self._queue.values())

    def priorities(self) -> list[Priority]:
        """The request priority of every job held (one per job)."""
        with self._lock:
            return list(self._priority.values())

    def entry_of(self, job_id: str) -> str | None:
        with self._lock:
            return self._held.get(job_id)

    def snapshot(self) -> dict[str, str]:
        with self._lock:
            return dict(self._held)

    def entries(self) -> dict[str, tuple[str, str]]:
        """job id -> (its entry's queue, entry id), one consistent snapshot."""
        with self._lock:
            return {job_id: (self._queue[job_id], entry_id) for job_id, entry_id in self._held.items()}

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)


class Housekeeper(threading.Thread):
    def __init__(
        self,
        jobs: JobQueue,
        leases: Leases,
        engine_inbox: queue.Queue,
        lease_ms: int,
        heartbeat_s: float,
        status: Callable[[], dict[str, Any]],
        metrics: Any | None = None,
        served: Any | None = None,
        adapters: Any | None = None,
    ) -> None:
        super().__init__(name="tokenbus-housekeeper", daemon=True)
        self.adapters = adapters  # ServedAdapters: the operator's adapter changes polled, loaded ones declared
        self.served = served  # ServedModels: whether it serves the default model is re-read every beat
        self.jobs = jobs
        self.leases = leases
        self.engine_inbox = engine_inbox
        self.renew_every_s = lease_ms / 3000
        self.heartbeat_s = heartbeat_s
        self.status = status  # the engine thread's latest numbers for the heartbeat
        self.metrics = metrics
        self.stop_event = threading.Event()
        self._cancels_sent: set[str] = set()
        self._unserved_logged: dict[str, float] = {}  # model -> when its model_unserved line was logged
        self.started_at = time.time()

    def stop(self) -> None:
        self.stop_event.set()

    def run(self) -> None:
        backoff = Backoff("housekeeping", self.stop_event, max_s=1.0)
        next_renew = next_beat = 0.0
        while not self.stop_event.is_set():
            now = time.monotonic()
            try:
                if now >= next_renew:
                    self.renew()
                    next_renew = now + self.renew_every_s
                self.poll_cancels()
                if now >= next_beat:
                    self.beat()
                    next_beat = now + self.heartbeat_s
                backoff.succeeded()
            except REDIS_DOWN as err:
                backoff.failed(err)
                continue
            except Exception:  # a bug here must not kill the thread that keeps the leases alive
                log.exception("housekeeping_error")
                self.stop_event.wait(1.0)
                continue
            self.stop_event.wait(min(CANCEL_POLL_S, self.renew_every_s))

    def renew(self) -> None:
        entries = self.leases.entries()
        if not entries:
            return
        lost = set(self.jobs.renew(list(entries.values())))
        for job_id, (_queue, entry_id) in entries.items():
            if entry_id in lost and self.leases.entry_of(job_id) == entry_id:
                # Another worker reclaimed it (our lease lapsed during an outage or a stall), or it was
                # acknowledged meanwhile: either way it is no longer ours to run.
                self.leases.release(job_id, entry_id)
                log.warning("job_lease_lost", job_id=job_id, entry_id=entry_id)
                self.engine_inbox.put(Revoke(job_id, "lost"))

    def _flag_unserved(self, infos: list[Any]) -> None:
        """A log line for each model with jobs and no live worker: when it starts, then once a minute."""
        now = time.monotonic()
        unserved = {m.id: m for m in infos if m.unserved}
        self._unserved_logged = {k: v for k, v in self._unserved_logged.items() if k in unserved}
        for mid, m in unserved.items():
            if now - self._unserved_logged.get(mid, -UNSERVED_LOG_EVERY_S) >= UNSERVED_LOG_EVERY_S:
                self._unserved_logged[mid] = now
                log.warning("model_unserved", model=mid or "(default queues)", jobs=m.queue_depth,
                            hint="its jobs wait until a worker serving it starts")

    def poll_cancels(self) -> None:
        requested = self.jobs.cancel_requests()
        held = self.leases.snapshot()
        self._cancels_sent &= held.keys()
        for job_id in requested & held.keys() - self._cancels_sent:
            self._cancels_sent.add(job_id)
            log.info("job_cancel_requested", job_id=job_id)
            self.engine_inbox.put(Revoke(job_id, "cancel"))

    def beat(self) -> None:
        if self.adapters is not None:  # before the heartbeat, which then confirms what it declared
            self.adapters.beat(self.jobs.r, self.engine_inbox)
        if self.served is not None:
            self.served.refresh_default(self.jobs.r)
            reads = self.served.read_ids()
            if reads != self.jobs.read_models:
                self.jobs.read_models = reads  # one list swapped whole: intake reads it unlocked
                self.jobs.ensure_group()
                log.info("served_queues_changed", serves_default=self.served.serves_default, reads=reads)
        status = self.status()
        beat = Heartbeat(name=self.jobs.consumer, pid=os.getpid(), started_at=self.started_at,
                         last_seen=time.time(), **status)
        self.jobs.heartbeat(beat, ttl_s=max(3 * int(self.heartbeat_s + 0.999), 10))
        infos = self.jobs.model_infos()
        self._flag_unserved(infos)
        if self.metrics is not None:
            self.metrics.observe_models(infos)
            self.metrics.observe_queue(*self.jobs.depth())
            held = Counter(p.value for p in self.leases.priorities())
            self.metrics.observe_priorities(dict(held))
