"""Every Redis call the worker makes: the job queues, job records, leases, results, the heartbeat.

JobQueue's methods are one round trip each; the completion writer batches its writes on a WriteBatch (one
pipeline). Retrying after a connection error is the caller's business, and every write here may be repeated
after an unknown outcome: the shared Lua scripts never end a job twice or overwrite an ended one."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import redis
import structlog

from protocol import model_status
from protocol import scripts as shared
from protocol.connection import on_shard
from protocol.keys import Keys
from protocol.models import EVENTS_MAXLEN, GROUP, JobResult
from protocol.priority import PRIORITIES
from protocol.records import DeadLetter, Heartbeat, ModelInfo
from worker.serve.backoff import REDIS_DOWN

log = structlog.get_logger("tokenbus.worker")

# Idle time given to a handed-back entry: past any worker's lease, so the next XAUTOCLAIM anywhere takes it.
# Not larger: the server subtracts it from "now" in milliseconds.
HAND_BACK_IDLE_MS = 10**10


@dataclass
class Entry:
    """One delivered stream entry, fields decoded to str."""

    entry_id: str
    fields: dict[str, str]
    queue: str = ""  # the stream it was read from ({ns}:q:{priority}[:{batch_id}])
    reclaimed: bool = False  # taken over from a worker whose lease lapsed
    not_utf8: tuple[str, ...] = ()  # fields whose bytes are not valid UTF-8 (decoded with U+FFFD here)


@dataclass
class Ending:
    """How one job ended, as the finish script writes it."""

    job_id: str
    entry_id: str  # "" = the record's own entry_id (in the record's queue)
    status: str  # "finished" | "failed" | "cancelled"
    result: JobResult | None = None
    error: str | None = None
    error_code: str | None = None
    finished_at: float | None = None
    queue: str = ""  # the stream of entry_id
    vectors: bytes = b""  # an embedding job's vectors (protocol/embeddings.py), written beside the record


def tokens_key(keys: Keys, job_id: str) -> str:
    """Stream of a streaming job's partial output: entries {offset, token_ids (JSON), text, done}.
    A write retried after an outage may repeat an entry: readers skip offsets they already have."""
    return keys.tokens(job_id)


class JobQueue:
    def __init__(self, client: redis.Redis, namespace: str, consumer: str, result_ttl_s: int,
                 min_replicas: int = 0, wait_ms: int = 1000) -> None:
        self.r = client
        # Durability: a batch of endings is followed by WAIT min_replicas wait_ms, so a result a client can
        # read has reached that many replicas and survives a failover (0 = the primary's word is enough).
        self.min_replicas = min_replicas
        self.wait_ms = wait_ms
        self.replicas_short = 0  # WAITs that timed out with fewer replicas than asked
        self.keys = Keys(namespace)
        # the models whose queues intake reads, '' = the default queues (ServedModels.read_ids; set at start)
        self.read_models: list[str] = [""]
        self.consumer = consumer
        self.result_ttl_s = result_ttl_s
        # Lua only the worker runs (protocol/lua/: read.lua, renew.lua, hand_back.lua, publish_tokens.lua)
        self._renew = shared.script(shared.lua("renew"))
        self._hand_back = shared.script(shared.lua("hand_back"))
        self._read = shared.script(shared.lua("read"))
        self._publish_tokens = shared.script(shared.lua("publish_tokens"))

    # ---- intake -------------------------------------------------------------------------------------

    def ensure_group(self) -> None:
        """The consumer group on each priority's loose queue of every model it reads (new batch queues get it
        from the submit script)."""
        for model in self.read_models:
            for p in PRIORITIES:
                shared.ensure_group(self.r, self.keys.for_model(model).queue(p))

    def read_new(self, count: int, block_ms: int | None, bulk_first: int = 0) -> list[Entry]:
        """Up to `count` new entries, interactive queues first, then default, then bulk, and turn by turn over
        the queues of one priority (protocol/lua/read.lua). With nothing to read and block_ms, wait up to that
        long for any queue to get an entry (XREAD, which takes nothing) and read once more. `bulk_first`
        of the count are read from the bulk queues first (the seats kept for bulk jobs)."""
        entries, wake = self._read_once(count, bulk_first)
        if entries or not block_ms or not wake:
            return entries
        streams = {_str(wake[i]): _str(wake[i + 1]) for i in range(0, len(wake), 2)}
        try:
            self.r.xread(streams, count=1, block=block_ms)
        except redis.ResponseError as err:  # a queue deleted while we waited (its batch ended), or worse:
            log.debug("intake_wait_interrupted", error=str(err))  # wait anyway, never spin on an error
            time.sleep(block_ms / 1000)
        return self._read_once(count, bulk_first)[0]

    def _read_once(self, count: int, bulk_first: int = 0) -> tuple[list[Entry], list[Any]]:
        out, wake = self._read(keys=[self.keys.routing_key],
                               args=[self.keys.layout, GROUP, self.consumer, count, bulk_first, *self.read_models],
                               client=self.r)
        return [_entry(eid, fields, _str(queue)) for queue, eid, fields in out], wake

    def queues(self) -> list[str]:
        """Every queue's stream key of the models it reads, interactive first, then default, then bulk."""
        streams = [shared.queue_streams(self.r, self.keys.for_model(m)) for m in self.read_models]
        return [q for p in PRIORITIES for s in streams for q in s[p.value]]

    def claim_lapsed(self, min_idle_ms: int, count: int, cursors: dict[str, str]) -> tuple[bool, list[Entry]]:
        """XAUTOCLAIM up to `count` entries whose lease lapsed (their worker died), queue by queue in priority
        order, each from its cursor in `cursors` (updated). Returns (every queue's pending list scanned to its
        end, entries)."""
        entries: list[Entry] = []
        complete = True
        for queue in self.queues():
            if len(entries) >= count:
                return False, entries
            try:
                reply = self.r.xautoclaim(queue, GROUP, self.consumer, min_idle_ms, cursors.get(queue, "0-0"),
                                          count=count - len(entries))
            except redis.ResponseError as err:  # no such stream or no group: nothing of ours to reclaim
                if "NOGROUP" not in str(err) and "no such key" not in str(err):
                    raise
                cursors.pop(queue, None)
                continue
            cursors[queue] = _str(reply[0])
            complete = complete and cursors[queue] == "0-0"
            # Entries deleted from the stream but still pending come back without fields (and Redis 7 drops
            # them from the PEL in the same call): nothing to run.
            entries += [_entry(eid, fields, queue) for eid, fields in reply[1] if fields]
        return complete, entries

    def start(self, job_id: str, entry_id: str, queue: str, backoff: shared.RetryBackoff | None = None,
              lease_ms: int = 0) -> tuple[str, int]:
        """('running', attempts) to run it; ('deferred', ms) a retry not due yet; else its terminal status or
        'missing' (entry acked already)."""
        return shared.start_job(self.r, self.keys, job_id, entry_id, self.consumer, queue, backoff=backoff,
                                lease_ms=lease_ms)

    def has_record(self, job_id: str) -> bool:
        """Whether `{ns}:job:{job_id}` is a job record (a hash): an entry naming it must end it."""
        return _str(self.r.type(self.keys.job(job_id))) == "hash"

    def dead_letter_now(self, letter: DeadLetter) -> None:
        self.dead_letter(self.r, letter)

    def drop_entry(self, entry_id: str, queue: str, dead: DeadLetter | None = None) -> None:
        """Acknowledge and delete an entry that names no job: there is no record to end. `dead` dead-letters it in
        the same transaction."""
        pipe = self.r.pipeline(transaction=True)
        if dead is not None:
            self.dead_letter(pipe, dead)
        shared.drop_entry(pipe, self.keys, queue, entry_id)
        pipe.execute()

    # ---- leases -------------------------------------------------------------------------------------

    def renew(self, held: list[tuple[str, str]]) -> list[str]:
        """Renew the leases of entries (queue, entry id) this worker holds; returns the ids it no longer holds."""
        if not held:
            return []
        lost = self._renew(keys=[q for q, _ in held], args=[GROUP, self.consumer, *(e for _, e in held)],
                           client=self.r)
        return [_str(x) for x in lost]

    def hand_back(self, pipe: redis.client.Pipeline, job_id: str, entry_id: str, queue: str,
                  count_attempt: bool) -> None:
        self._hand_back(
            keys=[self.keys.job(job_id), queue],
            args=[GROUP, self.consumer, entry_id, HAND_BACK_IDLE_MS, "0" if count_attempt else "1"],
            client=pipe,
        )

    def cancel_requests(self) -> set[str]:
        return {_str(x) for x in self.r.smembers(self.keys.cancel)}

    # ---- endings (queued on a pipeline: see WriteBatch) ---------------------------------------------------

    def write_batch(self) -> WriteBatch:
        return WriteBatch(self)

    def finish(self, pipe: redis.client.Pipeline, e: Ending) -> None:
        shared.finish_job(
            pipe, self.keys, e.job_id, e.status, entry_id=e.entry_id, queue=e.queue, result=e.result, error=e.error,
            error_code=e.error_code, now=e.finished_at, result_ttl=self.result_ttl_s, vectors=e.vectors,
        )

    def first_token(self, pipe: redis.client.Pipeline, job_id: str, at: float) -> None:
        shared.mark_first_token(pipe, self.keys, job_id, at)

    def dead_letter(self, pipe: redis.client.Pipeline | redis.Redis, letter: DeadLetter) -> None:
        pipe.xadd(self.keys.dead, letter.fields(self.consumer), maxlen=EVENTS_MAXLEN, approximate=True)

    def publish_tokens(self, pipe: redis.client.Pipeline, job_id: str, offset: int, token_ids: list[int],
                       text: str, done: bool) -> None:
        # one script: the stream expires by the record's result_ttl, as the record does (PUBLISH_TOKENS)
        self._publish_tokens(keys=[tokens_key(self.keys, job_id), self.keys.job(job_id)],
                             args=[offset, json.dumps(token_ids), text, int(done), self.result_ttl_s], client=pipe)

    # ---- presence -----------------------------------------------------------------------------------

    def heartbeat(self, beat: Heartbeat, ttl_s: int) -> None:
        pipe = self.r.pipeline(transaction=False)
        pipe.set(self.keys.worker(self.consumer), beat.model_dump_json(), ex=ttl_s)
        pipe.sadd(self.keys.workers, self.consumer)
        pipe.execute()

    def publish_config(self, values: dict[str, int]) -> None:
        if values:
            self.r.hset(self.keys.config, mapping=values)

    def sign_off(self) -> None:
        self.r.delete(self.keys.worker(self.consumer))

    def model_infos(self) -> list[ModelInfo]:
        """Every model of the namespace: depth by priority, pending, live workers (a few round trips)."""
        return model_status.model_infos(self.r, self.keys, model_status.live_heartbeats(self.r, self.keys))

    def depth(self) -> tuple[int, int]:
        """(entries in every queue it reads, delivered but unacknowledged) for the metrics: the depth counters,
        O(1) each."""
        ds = [shared.depth(self.r, self.keys.for_model(m)) for m in self.read_models]
        return sum(d.total for d in ds), sum(d.pending for d in ds)


class WriteBatch:
    """Writes queued on one pipeline and sent in one round trip. Each queuing method returns the index of its
    reply, so the caller can read the outcome of its own writes from execute()'s list."""

    def __init__(self, jobs: JobQueue) -> None:
        self.jobs = jobs
        self.pipe = jobs.r.pipeline(transaction=False)
        self._replies = 0
        self._endings = 0

    def _queued(self, replies: int) -> int:
        self._replies += replies
        return self._replies - 1

    def finish(self, e: Ending) -> int:
        """The finish script's reply: 1 ended now, 0 ended before, -1 no record."""
        self.jobs.finish(self.pipe, e)
        self._endings += 1
        return self._queued(1)

    def dead_letter(self, letter: DeadLetter) -> None:
        self.jobs.dead_letter(self.pipe, letter)
        self._queued(1)

    def hand_back(self, job_id: str, entry_id: str, queue: str, count_attempt: bool) -> None:
        self.jobs.hand_back(self.pipe, job_id, entry_id, queue, count_attempt)
        self._queued(1)

    def first_token(self, job_id: str, at: float) -> None:
        self.jobs.first_token(self.pipe, job_id, at)
        self._queued(1)

    def publish_tokens(self, job_id: str, offset: int, token_ids: list[int], text: str, done: bool) -> None:
        self.jobs.publish_tokens(self.pipe, job_id, offset, token_ids, text, done)
        self._queued(1)

    def execute(self) -> list[Any]:
        """Send everything. An outage raises (nothing is known to be written); a command Redis refuses comes
        back as -2 in its place, logged, so one refused write never holds up the others.

        With min_replicas, endings are followed by WAIT in the same round trip. A WAIT that times out short of
        min_replicas is logged and counted, not retried: the results are on the primary (readable now), and
        the replica catches up on its own unless the primary is lost in that window."""
        wait = self.jobs.min_replicas > 0 and self._endings > 0
        if wait:
            # In a Redis Cluster, on the namespace's shard: the connection that carried this batch's writes.
            self.pipe.execute_command("WAIT", self.jobs.min_replicas, self.jobs.wait_ms,
                                      **on_shard(self.jobs.r, self.jobs.keys.routing_key))
        replies = self.pipe.execute(raise_on_error=False)
        for reply in replies:
            if isinstance(reply, REDIS_DOWN):
                raise reply
        if wait:
            acked = replies.pop()
            if isinstance(acked, Exception) or int(acked) < self.jobs.min_replicas:
                self.jobs.replicas_short += 1
                log.warning("results_not_replicated", replicas=str(acked), wanted=self.jobs.min_replicas,
                            wait_ms=self.jobs.wait_ms, endings=self._endings)
        for i, reply in enumerate(replies):
            if isinstance(reply, Exception):
                log.error("write_refused", error=str(reply), reply_index=i)
                replies[i] = -2
        return replies


def _str(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def _entry(entry_id: Any, fields: Any, queue: str) -> Entry:
    """An Entry from a reply: fields as a dict (redis-py's XREADGROUP / XAUTOCLAIM) or a flat list (Lua)."""
    if isinstance(fields, list):
        fields = dict(zip(fields[::2], fields[1::2], strict=False))
    decoded: dict[str, str] = {}
    not_utf8: list[str] = []
    for k, v in (fields or {}).items():
        key = _str(k) if not isinstance(k, bytes) else k.decode("utf-8", "replace")
        if isinstance(v, bytes):
            try:
                v = v.decode("utf-8")
            except UnicodeDecodeError:
                not_utf8.append(key)
                v = v.decode("utf-8", "replace")
        decoded[key] = str(v)
    return Entry(_str(entry_id), decoded, queue, not_utf8=tuple(not_utf8))
