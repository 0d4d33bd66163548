"""A long stream of jobs written to Redis: SUBMIT_JOBS, one script call per few hundred jobs of one queue, the
calls sent on one connection while the next is built and their replies read a few calls behind, so the
client's work (validation, packing) overlaps Redis's (the scripts).

One call for many jobs, not one SUBMIT_JOB each: what is the same for every job of a queue (the layout, the
depth read, the registry and ready entries, the counter) is done once a call, and the client reads one reply
a call (docs/bench_million.md). redis-py's pipeline sends a chunk and then waits for all of its replies before
the caller can build the next one; here `depth` calls stay in flight. Commands are packed by hiredis when it
is installed (a C packer); replies are read by the connection's own parser. Every submit is idempotent, so a
call whose script Redis had forgotten (NOSCRIPT after a restart) is simply sent again once it is loaded.
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
from protocol.models import GROUP
from protocol.priority import Priority
from protocol.scripts import PendingJob

try:  # optional accelerator of the packing (a dependency of the client core: pyproject.toml)
    from hiredis import pack_command as _hiredis_pack
except ImportError:  # pragma: no cover - without it redis-py's own packer is used
    _hiredis_pack = None

log = structlog.get_logger("tokenbus.producer")

CALL_JOBS = 250  # jobs per SUBMIT_JOBS call: Redis is held ~1 ms a call, other clients wait no longer
DEPTH = 4  # calls in flight


class SubmitPipe:
    """add() jobs one by one (add_job: the same without a PendingJob), then close(); `queued` counts the jobs
    written (or found written: a resumed submit). on_chunk(n) is called with each call's job count once Redis
    has answered it (progress bars). chunk_size: jobs per call (consecutive jobs of one queue share one)."""

    def __init__(
        self,
        r: redis.Redis,
        keys: Keys,
        max_queue_len: int,
        result_ttl: int,
        *,
        chunk_size: int = CALL_JOBS,
        depth: int = DEPTH,
        on_chunk: Callable[[int], None] | None = None,
    ) -> None:
        # the raw pipelined socket below needs one node: a cluster's namespace lives on one shard
        self.r, self.keys = shard_client(r, keys.routing_key), keys
        self.limit, self.ttl = max_queue_len, result_ttl
        self.chunk_size, self.depth, self.on_chunk = chunk_size, depth, on_chunk
        self.sha = scripts.script(scripts.SUBMIT_JOBS).sha
        self.queued = 0
        self._where: tuple[str, str, str] | None = None  # (priority, batch_id, model) of the call being built
        self._ids: list[str] = []  # its job ids, records and (job_id, request, custom_id) triples
        self._records: list[str] = []
        self._args: list[str] = []
        self._flight: deque[tuple[list[str], tuple[str, str, str], bytes]] = deque()  # (job ids, where, call)
        self._conn = self.r.connection_pool.get_connection()
        self._layout = keys.layout
        self._record_prefix = keys.job("")
        self._loaded = False

    def __enter__(self) -> SubmitPipe:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None:  # replies may be left unread on the socket: drop the connection
            self._conn.disconnect()
        self.r.connection_pool.release(self._conn)

    def add(self, job: PendingJob) -> None:
        self.add_job(job.job_id, job.request_json, job.batch_id, job.custom_id, job.priority, job.model)

    def add_job(self, job_id: str, request_json: str, batch_id: str = "", custom_id: str = "",
                priority: str = Priority.default, model: str = "") -> None:
        if (priority, batch_id, model) != self._where:
            if self._ids:  # one call writes one queue
                self._send()
            self._where = (priority, batch_id, model)
        self._ids.append(job_id)
        self._records.append(self._record_prefix + job_id)
        self._args += (job_id, request_json, custom_id)
        if len(self._ids) >= self.chunk_size:
            self._send()

    def close(self) -> int:
        if self._ids:
            self._send()
        while self._flight:
            self._collect()
        return self.queued

    def _pack(self) -> bytes:
        assert self._where is not None
        priority, batch_id, model = self._where
        args = (  # the script finds the queue from the model, the priority and the batch
            "EVALSHA", self.sha, len(self._records), *self._records,
            repr(time.time()), self.limit, self.ttl, batch_id, Priority(priority).value, self._layout, GROUP, model,
            *self._args,
        )
        if _hiredis_pack is not None:
            return _hiredis_pack(args)
        return b"".join(self._conn.pack_command(*args))

    def _send(self) -> None:
        if not self._loaded:
            self.r.script_load(scripts.SUBMIT_JOBS)  # once: EVALSHA then finds it (NOSCRIPT is still handled)
            self._loaded = True
        data = self._pack()
        self._conn.send_packed_command([data])
        assert self._where is not None
        self._flight.append((self._ids, self._where, data))
        self._ids, self._records, self._args = [], [], []
        while len(self._flight) > self.depth:
            self._collect()

    def _read(self) -> object:
        try:
            return self._conn.read_response()
        except redis.ResponseError as err:  # the replies behind it are still on the socket: read on
            return err

    def _collect(self, retried: bool = False) -> None:
        """Read the reply of the oldest call in flight."""
        ids, where, data = self._flight.popleft()
        reply = self._read()
        if not retried and isinstance(reply, redis.exceptions.NoScriptError):
            # Redis forgot the script (restarted): the calls behind failed alike, or ran; send them all again
            # once it is loaded (a submit is idempotent: a job written already answers {0, status}).
            rest = list(self._flight)
            self._flight.clear()
            for _ in rest:
                self._read()
            log.warning("submit_script_reloaded", jobs=len(ids) + sum(len(j) for j, _, _ in rest))
            self.r.script_load(scripts.SUBMIT_JOBS)
            for item in [(ids, where, data), *rest]:
                self._conn.send_packed_command([item[2]])
                self._flight.append(item)
            self._collect(retried=True)
            return
        if isinstance(reply, Exception):
            raise reply
        if len(reply) != len(ids):  # type: ignore[arg-type]
            raise redis.ResponseError(f"SUBMIT_JOBS answered {len(reply)} replies for {len(ids)} jobs")  # type: ignore[arg-type]
        for i, (code, value) in enumerate(reply):  # type: ignore[arg-type]
            if code != 1 and code != 0:  # 1 queued now, 0 found queued already (a resumed submit)
                self.queued += i
                self._refused(ids[i], where, int(code), value)
        self.queued += len(ids)
        if self.on_chunk is not None:
            self.on_chunk(len(ids))

    def _refused(self, job_id: str, where: tuple[str, str, str], code: int, value: object) -> None:
        _priority, batch_id, model = where
        if code == scripts.NOT_DECLARED:
            raise scripts.model_not_found(self.keys, model, value)
        if code == -2:
            raise InvalidJob(
                f"job id {job_id!r} of batch {batch_id!r} is taken by another job (batch "
                f"{value or 'none'}); the batch would adopt that job's result. Use another batch id "
                f"({self.queued} jobs were queued before this one)"
            )
        log.warning("queue_full", namespace=self.keys.ns, depth=int(value), limit=self.limit,  # type: ignore[arg-type]
                    accepted=self.queued)
        raise QueueFull(
            f"queue full: {value} jobs queued in namespace {self.keys.ns!r} >= max_queue_len {self.limit}; "
            f"{self.queued} jobs of this submit were queued before it filled. Wait for the workers to "
            f"drain the queue or raise max_queue_len"
        )
