"""The Lua scripts (protocol/lua/*.lua, one file each, read from there) and thin Python wrappers with a
documented KEYS/ARGV order.

Every state change of a job record happens in one of these scripts, so each change is atomic with its
stream/event/batch side effects. A client in another language can EVAL the same files (docs/protocol.md).

Worker side:   start_job (queued -> running), mark_first_token, finish_job (-> finished | failed | cancelled)
Producer side: SUBMIT (via Client), SUBMIT_JOBS (a batch's ingest), cancel_job, bump_batch (via batches)
Worker only:   read, renew, hand_back, publish_tokens (worker/serve/job_queue.py)
Registry:      declare_model (a worker at start, `tokenbus models add`), retire_model (`tokenbus models remove`)
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from redis.cluster import ClusterPipeline
from redis.commands.core import Script

from protocol.cluster import ScriptPipeline
from protocol.errors import ModelNotFound, TokenbusError
from protocol.keys import Keys
from protocol.models import DEFAULT_RESULT_TTL, EVENTS_MAXLEN, GROUP, JobResult, JobStatus
from protocol.priority import PRIORITIES, Priority
from protocol.registry import DEFAULT_MODEL_FIELD, ModelRecord

CHUNK = 1000  # jobs per pipeline round trip


@dataclass
class PendingJob:
    """A validated job about to be written: the ARGV of SUBMIT_JOB."""

    job_id: str
    request_json: str
    batch_id: str = ""
    custom_id: str = ""
    priority: Priority = Priority.default  # picks its queue
    model: str = ""  # the request's model ('' = none: the default queues); with priority and batch_id, its queue


LUA_DIR = Path(__file__).with_name("lua")
_INCLUDE = re.compile(r"^-- #include (_\w+\.lua)$", re.MULTILINE)


def lua(name: str) -> str:
    """The text to EVAL of protocol/lua/NAME.lua: each `-- #include _FILE.lua` line replaced by that file (itself
    expanded the same way; a file already included is left out). Includes, not a Redis Functions library:
    EVAL/EVALSHA texts need nothing loaded beforehand, redis-py reloads them after a Redis restart (NOSCRIPT),
    and a client in another language runs them as they are (docs/protocol.md)."""
    seen: set[str] = set()

    def expand(file: str) -> str:
        if file in seen:
            return ""
        seen.add(file)
        return _INCLUDE.sub(lambda m: expand(m.group(1)).rstrip("\n"), (LUA_DIR / file).read_text())

    return expand(f"{name}.lua")


SUBMIT_JOB = lua("submit_job")
SUBMIT_JOBS = lua("submit_jobs")  # many jobs of one queue a call: a batch's ingest (producer/submit_pipe.py)
QUEUE_DEPTH = lua("queue_depth")
START_JOB = lua("start_job")
FIRST_TOKEN = lua("first_token")
FINISH_JOB = lua("finish_job")
CANCEL_JOB = lua("cancel_job")
BUMP_BATCH = lua("bump_batch")
START_BATCH = lua("start_batch")
CANCEL_BATCH = lua("cancel_batch")
DROP_ENTRY = lua("drop_entry")
DECLARE_MODEL = lua("declare_model")
RETIRE_MODEL = lua("retire_model")
ADAPTER_ADD = lua("adapter_add")
ADAPTER_REMOVE = lua("adapter_remove")
NOT_DECLARED = -3  # SUBMIT_JOB(S)'s reply code for a model nobody declared: {-3, JSON list of the declared ids}


class _Script(Script):
    """A redis-py Script bound to no client: pass client= (a Redis, a RedisCluster or a pipeline) on each call.

    EVALSHA first; redis-py loads the text on NOSCRIPT (e.g. after a Redis restart)."""

    def __init__(self, text: str) -> None:
        self.registered_client = None
        self.script = text
        self.sha = hashlib.sha1(text.encode()).hexdigest()

    def __call__(self, keys=(), args=(), client=None):  # noqa: ANN001, ANN204 (redis-py's signature)
        # redis-py refuses EVALSHA in a Redis Cluster pipeline (it could not load the script on NOSCRIPT): the
        # pipelines of protocol.cluster.ScriptCluster (what redis_from_url makes) load it on the shard and send
        # EVALSHA; any other cluster pipeline gets EVAL with the text, ~3-4 KB more per call (docs/deployment.md).
        if isinstance(client, ScriptPipeline):
            return client.queue_script(self.script, self.sha, list(keys), list(args))
        if isinstance(client, ClusterPipeline):
            return client.execute_command("EVAL", self.script, len(keys), *keys, *args)
        return super().__call__(keys=keys, args=args, client=client)


_SCRIPTS: dict[str, _Script] = {}


def script(text: str) -> _Script:
    s = _SCRIPTS.get(text)
    if s is None:
        s = _SCRIPTS[text] = _Script(text)
    return s


def _s(value: Any) -> Any:
    return value.decode() if isinstance(value, bytes) else value


def _run(r: redis.Redis, text: str, keys: list[str], args: list[Any]) -> Any:
    return script(text)(keys=keys, args=args, client=r)


def start_job(r: redis.Redis, keys: Keys, job_id: str, entry_id: str, worker: str, queue: str = "",
              now: float | None = None, group: str = GROUP, backoff: RetryBackoff | None = None,
              lease_ms: int = 0) -> tuple[str, int]:
    """Worker: mark a job delivered from `queue` ('' = the default loose queue) running. Returns (status,
    attempts): run it only if 'running'; ('deferred', ms): a retry after a transient fault, due in ms (with
    `backoff`, its delay is set here when the fault is first seen; the entry is claimable again when due)."""
    spec = "" if backoff is None else f"{backoff.base_ms},{backoff.max_ms},{random.random():.6f}"
    status, attempts = _run(r, START_JOB, [keys.job(job_id), queue or keys.queue()],
                            [group, entry_id, worker, now or time.time(), keys.layout, spec, lease_ms,
                             BACKOFF_CONSUMER])
    return _s(status), int(attempts)


BACKOFF_CONSUMER = "backoff"  # the group consumer a retry waiting for its backoff is pending under (START_JOB)


@dataclass(frozen=True)
class RetryBackoff:
    """Exponential backoff with jitter between the attempts of a job that had a transient fault: attempt k+1
    waits min(max_ms, base_ms x 2^(k-1)) x a random factor in [0.5, 1) ("equal jitter")."""

    base_ms: int = 1000
    max_ms: int = 60_000

    def bounds_s(self, attempt: int) -> tuple[float, float]:
        """The shortest and longest wait (seconds) after attempt `attempt` failed."""
        full = min(self.max_ms, self.base_ms * 2 ** (attempt - 1)) / 1000
        return full / 2, full


def mark_first_token(r: redis.Redis, keys: Keys, job_id: str, now: float | None = None) -> bool:
    return bool(_run(r, FIRST_TOKEN, [keys.job(job_id)], [now or time.time()]))


def finish_job(
    r: redis.Redis,
    keys: Keys,
    job_id: str,
    status: JobStatus | str,
    *,
    entry_id: str = "",
    queue: str = "",
    result: JobResult | dict | str | None = None,
    error: str | None = None,
    error_code: str | None = None,
    now: float | None = None,
    result_ttl: int = DEFAULT_RESULT_TTL,
    group: str = GROUP,
    vectors: bytes = b"",
) -> int:
    """End a job (worker side): 1 ended now, 0 was already terminal (left as is), -1 no record.

    `vectors`: an embedding job's raw vectors, written to keys.vectors(job_id) (with the record's TTL) only when
    the job ends now.

    The stream entry (entry_id in `queue`, '' = the default loose queue; no entry_id: the record's own) is
    acked and deleted in every case. `r` may be a pipeline (then the return value
    comes from pipe.execute()). result_ttl is only the fallback for records written without one.
    """
    if isinstance(result, dict):
        result = JobResult.model_validate(result)
    usage = ""  # summed into the job's batch (batch usage)
    if isinstance(result, JobResult):
        u = result.usage
        usage = f"[{u.prompt_tokens},{u.cached_tokens},{u.completion_tokens}]"
        result = result.model_dump_json()
    status = JobStatus(status)
    out = _run(r, FINISH_JOB, [keys.job(job_id), queue or keys.queue(), keys.events, keys.cancel, keys.tokens(job_id),
                               keys.vectors(job_id)],
               [group, entry_id, job_id, status.value, result or "", error or "", error_code or "",
                now or time.time(), result_ttl, keys.layout, EVENTS_MAXLEN, vectors, usage])
    return out if not isinstance(out, int | bytes | str) else int(out)


def cancel_job(r: redis.Redis, keys: Keys, job_id: str, now: float | None = None,
               result_ttl: int = DEFAULT_RESULT_TTL, group: str = GROUP) -> str:
    """'cancelled' | 'cancelling' | the job's terminal status | '' (no such job). `r` may be a pipeline."""
    out = _run(r, CANCEL_JOB, [keys.job(job_id), keys.events, keys.cancel, keys.tokens(job_id)],
               [group, job_id, now or time.time(), result_ttl, keys.layout, EVENTS_MAXLEN])
    return _s(out)


def bump_batch(r: redis.Redis, keys: Keys, batch_id: str, status: str, now: float, result_ttl: int) -> None:
    """Count a job of the batch that will never run (never written) as ended with `status`."""
    _run(r, BUMP_BATCH, [keys.routing_key], [keys.layout, batch_id, status, now, result_ttl])


def submit_args(keys: Keys, job: PendingJob, now: float, max_queue_len: int, result_ttl: int,
                group: str = GROUP) -> tuple[list[str], list[Any]]:
    """(KEYS, ARGV) of SUBMIT_JOB for one job (its queue is found by the script from its model and priority)."""
    return ([keys.job(job.job_id)],
            [job.job_id, job.request_json, now, max_queue_len, result_ttl, job.batch_id, job.custom_id,
             job.priority, keys.layout, group, job.model])


def model_not_found(keys: Keys, model: str, declared_json: Any) -> ModelNotFound:
    """The error of a submit the script refused with NOT_DECLARED (its reply lists the declared ids)."""
    try:
        declared = json.loads(_s(declared_json)) or []
    except ValueError:
        declared = []
    return ModelNotFound(model, [str(d) for d in declared], keys.ns)


def drop_entry(r: redis.Redis | redis.client.Pipeline, keys: Keys, queue: str, entry_id: str,
               group: str = GROUP) -> Any:
    """Worker: XACK + XDEL an entry that names no job to end, counted in the depth counter. 1 deleted, 0 gone
    already (`r` may be a pipeline)."""
    return _run(r, DROP_ENTRY, [queue], [group, entry_id, keys.layout])


@dataclass
class Depth:
    """The depth counter `{ns}:depth` (protocol/lua/_queue_depth.lua), read in O(1)."""

    total: int  # entries in every queue: queued + running (what max_queue_len bounds)
    pending: int  # delivered by READ, not acknowledged yet
    by_priority: dict[str, int]


def depth(r: redis.Redis, keys: Keys) -> Depth:
    """The depth counter of `keys.model`'s queues ('' = the default queues; recounted from the queues first if
    it is missing)."""
    total, pending, *each = _run(r, QUEUE_DEPTH, [keys.routing_key], [keys.layout, keys.model])
    return Depth(int(total), int(pending), {p.value: int(n) for p, n in zip(PRIORITIES, each, strict=True)})


def queue_depth(r: redis.Redis, keys: Keys) -> int:
    """Entries in every queue of `keys.model` (or the default queues): what max_queue_len bounds (the counter,
    O(1))."""
    return depth(r, keys).total


def queue_streams(r: redis.Redis, keys: Keys) -> dict[str, list[str]]:
    """priority -> the stream keys of `keys.model`'s queues of it (loose queue first, then its batches)."""
    pipe = r.pipeline(transaction=False)
    for p in PRIORITIES:
        pipe.zrange(keys.registry(p), 0, -1)
    out: dict[str, list[str]] = {}
    for p, members in zip(PRIORITIES, pipe.execute(), strict=True):
        out[p.value] = [keys.queue(p), *(_s(m) for m in members)]
    return out


def queue_counts(r: redis.Redis, keys: Keys) -> dict[str, tuple[int, int]]:
    """priority -> (entries in its queues, entries of them delivered to a worker and not yet acknowledged),
    recounted from every queue of `keys.model` (or the default queues): O(live batches). What the depth counter
    must equal (tests, repair), split by priority as the counter's `pending` is not; `depth` reads the counter."""
    by_priority = queue_streams(r, keys)
    pipe = r.pipeline(transaction=False)
    for q in (q for qs in by_priority.values() for q in qs):
        pipe.xlen(q).xpending(q, GROUP)
    replies = iter(pipe.execute(raise_on_error=False))  # a queue without a group (or stream) answers an error
    out: dict[str, tuple[int, int]] = {}
    for priority, streams in by_priority.items():
        depth = pending = 0
        for _ in streams:
            length, summary = next(replies), next(replies)
            for reply in (length, summary):
                if isinstance(reply, redis.ConnectionError | redis.TimeoutError):
                    raise reply
            depth += length if isinstance(length, int) else 0
            pending += int(summary["pending"]) if isinstance(summary, dict) else 0
        out[priority] = (depth, pending)
    return out


def queue_totals(r: redis.Redis, keys: Keys) -> tuple[int, int]:
    """(entries in every queue, entries delivered to a worker and not yet acknowledged): queue_counts summed."""
    counts = queue_counts(r, keys).values()
    return sum(d for d, _ in counts), sum(p for _, p in counts)


def ensure_group(r: redis.Redis, stream: str, group: str = GROUP) -> None:
    """Create the consumer group on `stream` at id 0 (so no entry written before it is skipped); a no-op if it
    exists."""
    try:
        r.xgroup_create(stream, group, id="0", mkstream=True)
    except redis.ResponseError as err:
        if "BUSYGROUP" not in str(err):
            raise


def declare_model(r: redis.Redis, keys: Keys, record: ModelRecord) -> list[str]:
    """Declare a model (DECLARE_MODEL): the ids of the models its declarer serves, its own first. TokenbusError
    naming both sides when one of its names is held by a model of another checkpoint."""
    out = _run(r, DECLARE_MODEL, [keys.models, keys.model_names, keys.config],
               [record.to_json(), DEFAULT_MODEL_FIELD])
    code, *rest = (_s(x) for x in out)
    if int(code) == -1:
        name, owner, checkpoint = rest
        raise TokenbusError(
            f"model name {name!r} is already model {owner!r}'s, served from checkpoint {checkpoint}; this one "
            f"({record.id!r}) is checkpoint {record.checkpoint or 'unknown'}. Two checkpoints cannot share a "
            f"name: start this one with another --served-model-name, or retire {owner!r} first "
            f"(tokenbus models remove {owner})")
    return rest


def retire_model(r: redis.Redis, keys: Keys, model_id: str, force: bool = False) -> tuple[int, int]:
    """Retire a model (RETIRE_MODEL): (1 retired | 0 not declared | -1 kept: jobs queued, not forced, jobs)."""
    code, jobs = _run(r, RETIRE_MODEL, [keys.models, keys.model_names, keys.config],
                      [model_id, keys.layout, "1" if force else "0", DEFAULT_MODEL_FIELD])
    return int(code), int(jobs)


def add_adapter(r: redis.Redis, keys: Keys, name: str, base: str, path: str) -> list[Any]:
    """ADAPTER_ADD: [1 | 0, rev, base id] written or already so; [-1, declared ids JSON] no such base; [-2, base]
    the base is an adapter; [-3, owner] the name is another model's."""
    out = _run(r, ADAPTER_ADD, [keys.adapters, keys.models, keys.model_names], [name, base, path, time.time()])
    return [int(out[0]), *(_s(x) for x in out[1:])]


def remove_adapter(r: redis.Redis, keys: Keys, name: str, force: bool = False) -> list[Any]:
    """ADAPTER_REMOVE: [1, rev, base id, jobs] removed; [0, rev, base id] none of that name; [-1, jobs] kept
    (jobs queued, not forced); [-2, id] a base model."""
    out = _run(r, ADAPTER_REMOVE, [keys.adapters, keys.models, keys.model_names, keys.config],
               [name, keys.layout, "1" if force else "0", DEFAULT_MODEL_FIELD, time.time()])
    return [int(out[0]), *(_s(x) for x in out[1:])]
