"""SUBMIT_JOB for a long stream of jobs: chunks sent on one connection while the next chunk is built, replies
read a chunk behind, so the client's work (validation, packing) overlaps Redis's (the scripts).

redis-py's pipeline sends a chunk and then waits for all of its replies before the caller can build the next
one; here `depth` chunks stay in flight. Commands are packed by hiredis when it is installed (a C packer: the
Python one costs more per job than the script itself); replies are read by the connection's own parser.
Every SUBMIT_JOB is idempotent, so a chunk whose scripts Redis had forgotten (NOSCRIPT after a restart) is
simply sent again once the script is loaded.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import redis
import structlog

from protocol import scripts
from protocol.connection import shard_client
from protocol.errors import InvalidJob, QueueFull
from protocol.keys import Keys
from protocol.models import GROUP, Priority
from protocol.scripts import CHUNK, PendingJob

try:  # optional accelerator of the packing (a dependency of the client core: pyproject.toml)
    from hiredis import pack_command as _hiredis_pack
except ImportError:  # pragma: no cover - without it redis-py's own packer is used
    _hiredis_pack = None

log = structlog.get_logger("tokenbus.producer")


class SubmitPipe:
    """add() jobs one by one, then close(); `queued` counts the jobs written (or found written: a resumed
    submit). on_chunk(n) is called with each chunk's size once Redis has answered it (progress bars)."""

    def __init__(
        self,
        r: redis.Redis,
        keys: Keys,
        max_queue_len: int,
        result_ttl: int,
        *,
        chunk_size: int = CHUNK,
        depth: int = 2,
        on_chunk: Callable[[int], None] | None = None,
    ) -> None:
        # the raw pipelined socket below needs one node: a cluster's namespace lives on one shard
        self.r, self.keys = shard_client(r, keys.routing_key), keys
        self.limit, self.ttl = max_queue_len, result_ttl
        self.chunk_size, self.depth, self.on_chunk = chunk_size, depth, on_chunk
        self.sha = scripts.script(scripts.SUBMIT_JOB).sha
        self.queued = 0
        self._jobs: list[PendingJob] = []
        self._packed: list[bytes] = []
        self._flight: deque[tuple[list[PendingJob], bytes]] = deque()
        self._conn = self.r.connection_pool.get_connection()
        self._layout = keys.layout
        self._queues: dict[tuple[str, str], tuple[str, str, str]] = {}
        self._loaded = False

    def __enter__(self) -> SubmitPipe:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None:  # replies may be left unread on the socket: drop the connection
            self._conn.disconnect()
        self.r.connection_pool.release(self._conn)

    def add(self, job: PendingJob) -> None:
        if not self._loaded:
            self.r.script_load(scripts.SUBMIT_JOB)  # once: EVALSHA then finds it (NOSCRIPT is still handled)
            self._loaded = True
        self._jobs.append(job)
        self._packed.append(self._pack(job))
        if len(self._jobs) >= self.chunk_size:
            self._send()

    def close(self) -> int:
        if self._jobs:
            self._send()
        while self._flight:
            self._collect()
        return self.queued

    def _pack(self, job: PendingJob) -> bytes:
        where = self._queues.get((job.priority, job.batch_id))
        if where is None:  # a batch's jobs share one queue: its key names are built once
            p = Priority(job.priority)
            where = self._queues[(job.priority, job.batch_id)] = (
                self.keys.queue(p, job.batch_id),
                self.keys.registry(p),
                p.value,
            )
        queue, registry, priority = where
        args = (
            "EVALSHA",
            self.sha,
            3,
            self.keys.job(job.job_id),
            queue,
            registry,
            job.job_id,
            job.request_json,
            repr(time.time()),
            self.limit,
            self.ttl,
            job.batch_id,
            job.custom_id,
            priority,
            self._layout,
            GROUP,
        )
        if _hiredis_pack is not None:
            return _hiredis_pack(args)
        return b"".join(self._conn.pack_command(*args))

    def _send(self) -> None:
        data = b"".join(self._packed)
        self._conn.send_packed_command([data])
        self._flight.append((self._jobs, data))
        self._jobs, self._packed = [], []
        while len(self._flight) > self.depth:
            self._collect()

    def _read(self, n: int) -> list[object]:
        replies: list[object] = []
        for _ in range(n):
            try:
                replies.append(self._conn.read_response())
            except redis.ResponseError as err:  # the other replies are still on the socket: read on
                replies.append(err)
        return replies

    def _collect(self, retried: bool = False) -> None:
        """Read the replies of the oldest chunk in flight."""
        jobs, data = self._flight.popleft()
        replies = self._read(len(jobs))
        if not retried and any(isinstance(x, redis.exceptions.NoScriptError) for x in replies):
            # Redis forgot the script (restarted): the chunks behind failed alike, or ran; send them all again
            # once it is loaded (SUBMIT_JOB is idempotent: a job written already answers {0, status}).
            rest = list(self._flight)
            self._flight.clear()
            for later, _ in rest:
                self._read(len(later))
            log.warning("submit_script_reloaded", jobs=len(jobs) + sum(len(j) for j, _ in rest))
            self.r.script_load(scripts.SUBMIT_JOB)
            for item in [(jobs, data), *rest]:
                self._conn.send_packed_command([item[1]])
                self._flight.append(item)
            self._collect(retried=True)
            return
        for job, reply in zip(jobs, replies, strict=True):
            if isinstance(reply, Exception):
                raise reply
            code, value = reply
            if int(code) == -2:
                raise InvalidJob(
                    f"job id {job.job_id!r} of batch {job.batch_id!r} is taken by another job (batch "
                    f"{value or 'none'}); the batch would adopt that job's result. Use another batch id "
                    f"({self.queued} jobs were queued before this one)"
                )
            if int(code) == -1:
                log.warning(
                    "queue_full", namespace=self.keys.ns, depth=int(value), limit=self.limit, accepted=self.queued
                )
                raise QueueFull(
                    f"queue full: {value} jobs queued in namespace {self.keys.ns!r} >= max_queue_len {self.limit}; "
                    f"{self.queued} jobs of this submit were queued before it filled. Wait for the workers to "
                    f"drain the queue or raise max_queue_len"
                )
            self.queued += 1
        if self.on_chunk is not None:
            self.on_chunk(len(jobs))
