"""The Lua scripts both sides run, one copy each, and thin Python wrappers with a documented KEYS/ARGV order.

Every state change of a job record happens in one of these scripts, so each change is atomic with its
stream/event/batch side effects. A client in another language can EVAL the same text (docs/protocol.md).

Worker side:   start_job (queued -> running), mark_first_token, finish_job (-> finished | failed | cancelled)
Producer side: SUBMIT (via Client), cancel_job, bump_batch (via batches)
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any

import redis
from redis.commands.core import Script

from protocol.models import (
    DEFAULT_RESULT_TTL,
    EVENTS_MAXLEN,
    GROUP,
    PRIORITIES,
    JobResult,
    JobStatus,
    Keys,
    Priority,
)

CHUNK = 1000  # jobs per pipeline round trip


@dataclass
class PendingJob:
    """A validated job about to be written: the ARGV of SUBMIT_JOB."""

    job_id: str
    request_json: str
    batch_id: str = ""
    custom_id: str = ""
    priority: str = "default"  # interactive | default | bulk: picks its queue


# Shared Lua: count one ended job in its batch, and end the batch when every job has ended. An ended batch's
# queue leaves its priority's registry (intake stops visiting it) and, once empty, is deleted.
# status is the job's terminal status, which is also the counter's field name.
_BUMP_BATCH_FN = """
local function bump_batch(ns, batch_id, status, now, ttl)
  if not batch_id or batch_id == '' then return end
  local bkey = ns .. ':batch:' .. batch_id
  if redis.call('EXISTS', bkey) == 0 then return end
  redis.call('HINCRBY', bkey, status, 1)
  local v = redis.call('HMGET', bkey, 'total', 'finished', 'failed', 'cancelled', 'status', 'queue', 'priority')
  local done = tonumber(v[2] or 0) + tonumber(v[3] or 0) + tonumber(v[4] or 0)
  if done >= tonumber(v[1] or 0) and v[5] ~= 'completed' and v[5] ~= 'cancelled' then
    local final = 'completed'
    if v[5] == 'cancelling' then final = 'cancelled' end
    redis.call('HSET', bkey, 'status', final, 'completed_at', now)
    if v[6] and v[6] ~= '' then
      redis.call('ZREM', ns .. ':queues:' .. (v[7] or 'default'), v[6])
      if redis.call('XLEN', v[6]) == 0 then redis.call('DEL', v[6]) end
    end
    if ttl and ttl > 0 then
      redis.call('EXPIRE', bkey, ttl)
      redis.call('EXPIRE', bkey .. ':jobs', ttl)
    end
  end
end
"""
_IS_TERMINAL_FN = """
local function is_terminal(s) return s == 'finished' or s == 'failed' or s == 'cancelled' end
"""

# Shared Lua: entries in every queue (loose, batch, the pre-priority {ns}:jobs): what max_queue_len bounds.
_QUEUE_DEPTH_FN = """
local function queue_depth(ns)
  local n = redis.call('XLEN', ns .. ':jobs')
  for _, p in ipairs({'interactive', 'default', 'bulk'}) do
    n = n + redis.call('XLEN', ns .. ':q:' .. p)
    for _, q in ipairs(redis.call('ZRANGE', ns .. ':queues:' .. p, 0, -1)) do n = n + redis.call('XLEN', q) end
  end
  return n
end
"""

SUBMIT_JOB = _QUEUE_DEPTH_FN + """
-- KEYS: 1 record {ns}:job:{id}, 2 queue {ns}:q:{priority} (loose) or {ns}:q:{priority}:{batch_id} (a batch's),
--       3 registry {ns}:queues:{priority}
-- ARGV: 1 job_id, 2 request JSON, 3 now, 4 max_queue_len (0 = no limit; counts every queue), 5 result_ttl,
--       6 batch_id ('' = none), 7 custom_id ('' = none), 8 priority (interactive | default | bulk),
--       9 namespace, 10 consumer group
-- returns {1, entry_id} queued | {0, status} already exists (idempotent) | {-1, depth} queue full
--       | {-2, its batch_id} a batch job (ARGV 6 set) whose id is taken by a job outside that batch
--       | an error reply: a priority not among the three, or KEYS 2-3 not its queue and registry
-- Any existing key refuses the submit (EXISTS, not HGET status): a job is never reset or overwritten.
-- A new queue gets the consumer group; a batch queue joins its priority's registry (workers read from there).
local prio = ARGV[8]
if prio ~= 'interactive' and prio ~= 'default' and prio ~= 'bulk' then
  return redis.error_reply('ERR submit: priority must be interactive, default or bulk, got ' .. prio)
end
local queue = ARGV[9] .. ':q:' .. prio
if ARGV[6] ~= '' then queue = queue .. ':' .. ARGV[6] end
if KEYS[2] ~= queue or KEYS[3] ~= ARGV[9] .. ':queues:' .. prio then
  return redis.error_reply('ERR submit: KEYS[2] must be ' .. queue .. ' and KEYS[3] ' .. ARGV[9] ..
                           ':queues:' .. prio)
end
if redis.call('EXISTS', KEYS[1]) == 1 then
  local cur = redis.call('HMGET', KEYS[1], 'status', 'batch_id')
  if ARGV[6] ~= '' and cur[2] ~= ARGV[6] then return {-2, cur[2] or ''} end
  return {0, cur[1] or ''}
end
local limit = tonumber(ARGV[4])
if limit > 0 then
  local depth = queue_depth(ARGV[9])
  if depth >= limit then return {-1, tostring(depth)} end
end
if redis.call('EXISTS', KEYS[2]) == 0 then redis.call('XGROUP', 'CREATE', KEYS[2], ARGV[10], '0', 'MKSTREAM') end
if ARGV[6] ~= '' then redis.call('ZADD', KEYS[3], 'NX', ARGV[3], KEYS[2]) end
local entry = redis.call('XADD', KEYS[2], '*', 'job_id', ARGV[1], 'request', ARGV[2])
redis.call('HSET', KEYS[1], 'id', ARGV[1], 'status', 'queued', 'request', ARGV[2], 'created_at', ARGV[3],
           'attempts', 0, 'result_ttl', ARGV[5], 'entry_id', entry, 'queue', KEYS[2], 'priority', prio)
if ARGV[6] ~= '' then redis.call('HSET', KEYS[1], 'batch_id', ARGV[6]) end
if ARGV[7] ~= '' then redis.call('HSET', KEYS[1], 'custom_id', ARGV[7]) end
return {1, entry}
"""

QUEUE_DEPTH = _QUEUE_DEPTH_FN + """
-- KEYS: none (the queues are found from the namespace). ARGV: 1 namespace. Returns the entries in every queue.
return queue_depth(ARGV[1])
"""

START_JOB = _IS_TERMINAL_FN + """
-- KEYS: 1 record, 2 the queue (stream) the entry was read from
-- ARGV: 1 group, 2 entry_id, 3 worker name, 4 now
-- returns {'running', attempts} (run it) | {status, 0} terminal: skip (entry acked+deleted)
--       | {'missing', 0} no record (expired or never submitted): skip (entry acked+deleted)
local status = redis.call('HGET', KEYS[1], 'status')
if (not status) or is_terminal(status) then
  redis.call('XACK', KEYS[2], ARGV[1], ARGV[2])
  redis.call('XDEL', KEYS[2], ARGV[2])
  return {status or 'missing', 0}
end
redis.call('HSET', KEYS[1], 'status', 'running', 'started_at', ARGV[4], 'worker', ARGV[3],
           'entry_id', ARGV[2], 'queue', KEYS[2])
redis.call('HDEL', KEYS[1], 'first_token_at')
return {'running', redis.call('HINCRBY', KEYS[1], 'attempts', 1)}
"""

FIRST_TOKEN = """
-- KEYS: 1 record; ARGV: 1 now. Sets first_token_at only while running (never recreates an expired record).
if redis.call('HGET', KEYS[1], 'status') == 'running' then
  redis.call('HSET', KEYS[1], 'first_token_at', ARGV[1])
  return 1
end
return 0
"""

FINISH_JOB = _IS_TERMINAL_FN + _BUMP_BATCH_FN + """
-- KEYS: 1 record, 2 the entry's queue (with ARGV 2 ''; the record's queue, else this), 3 stream {ns}:events,
--       4 set {ns}:cancel
-- ARGV: 1 group, 2 entry_id ('' = the record's entry_id, in the record's queue), 3 job_id,
--       4 status (finished|failed|cancelled), 5 result JSON ('' = none), 6 error message ('' = none),
--       7 error_code ('' = none), 8 now,
--       9 default result_ttl (used when the record has none), 10 namespace, 11 events maxlen
-- returns 1 ended now | 0 was already terminal (not overwritten) | -1 no record; the entry is always
--         acked + deleted and the id removed from the cancel set
local st = ARGV[4]
if not is_terminal(st) then
  return redis.error_reply('ERR finish: status must be finished, failed or cancelled, got ' .. st)
end
local cur = redis.call('HMGET', KEYS[1], 'status', 'entry_id', 'result_ttl', 'batch_id', 'queue')
local entry, stream = ARGV[2], KEYS[2]
if entry == '' and cur[2] then entry, stream = cur[2], cur[5] or KEYS[2] end
redis.call('SREM', KEYS[4], ARGV[3])
local function ack()
  if entry ~= '' then
    redis.call('XACK', stream, ARGV[1], entry)
    redis.call('XDEL', stream, entry)
  end
end
if not cur[1] then ack() return -1 end
if is_terminal(cur[1]) then ack() return 0 end
redis.call('HSET', KEYS[1], 'status', st, 'finished_at', ARGV[8])
if ARGV[5] ~= '' then redis.call('HSET', KEYS[1], 'result', ARGV[5]) end
if ARGV[6] ~= '' then redis.call('HSET', KEYS[1], 'error', ARGV[6]) end
if ARGV[7] ~= '' then redis.call('HSET', KEYS[1], 'error_code', ARGV[7]) end
local ttl = tonumber(cur[3] or ARGV[9])
if ttl and ttl > 0 then redis.call('EXPIRE', KEYS[1], ttl) end
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[11], '*', 'job_id', ARGV[3], 'status', st)
ack()  -- before bump_batch: the batch's last entry gone, its ended queue can be deleted
bump_batch(ARGV[10], cur[4], st, ARGV[8], ttl)
return 1
"""

CANCEL_JOB = _IS_TERMINAL_FN + _BUMP_BATCH_FN + """
-- KEYS: 1 record, 2 stream {ns}:jobs (the queue of a record without a `queue` field: written before
--       priorities), 3 stream {ns}:events, 4 set {ns}:cancel
-- ARGV: 1 group, 2 job_id, 3 now, 4 default result_ttl, 5 namespace, 6 events maxlen
-- returns 'cancelled' (was queued: ended now, entry removed) | 'cancelling' (running: the worker aborts it)
--       | its terminal status (no-op) | '' no such job
local cur = redis.call('HMGET', KEYS[1], 'status', 'entry_id', 'result_ttl', 'batch_id', 'queue')
if not cur[1] then return '' end
if is_terminal(cur[1]) then return cur[1] end
if cur[1] == 'running' then
  redis.call('SADD', KEYS[4], ARGV[2])
  return 'cancelling'
end
redis.call('HSET', KEYS[1], 'status', 'cancelled', 'finished_at', ARGV[3],
           'error', 'cancelled before it started', 'error_code', 'cancelled')
local ttl = tonumber(cur[3] or ARGV[4])
if ttl and ttl > 0 then redis.call('EXPIRE', KEYS[1], ttl) end
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[6], '*', 'job_id', ARGV[2], 'status', 'cancelled')
if cur[2] then
  redis.call('XACK', cur[5] or KEYS[2], ARGV[1], cur[2])
  redis.call('XDEL', cur[5] or KEYS[2], cur[2])
end
bump_batch(ARGV[5], cur[4], 'cancelled', ARGV[3], ttl)
return 'cancelled'
"""

BUMP_BATCH = _BUMP_BATCH_FN + """
-- KEYS: none. ARGV: 1 namespace, 2 batch_id, 3 status, 4 now, 5 ttl. Counts a job that will never run.
bump_batch(ARGV[1], ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[5]))
return 1
"""

START_BATCH = """
-- KEYS: 1 batch record. ARGV: 1 now. validating -> in_progress (never undoes completed/cancelling).
if redis.call('HGET', KEYS[1], 'status') == 'validating' then
  redis.call('HSET', KEYS[1], 'status', 'in_progress', 'in_progress_at', ARGV[1])
  return 1
end
return 0
"""

CANCEL_BATCH = """
-- KEYS: 1 batch record. ARGV: 1 now. validating|in_progress -> cancelling; returns the status after.
local s = redis.call('HGET', KEYS[1], 'status')
if not s then return '' end
if s == 'validating' or s == 'in_progress' then
  redis.call('HSET', KEYS[1], 'status', 'cancelling', 'cancelled_at', ARGV[1])
  return 'cancelling'
end
return s
"""

class _Script(Script):
    """A redis-py Script bound to no client: pass client= (a Redis or a Pipeline) on each call.

    EVALSHA first; redis-py loads the text on NOSCRIPT (e.g. after a Redis restart)."""

    def __init__(self, text: str) -> None:
        self.registered_client = None
        self.script = text
        self.sha = hashlib.sha1(text.encode()).hexdigest()


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
              now: float | None = None, group: str = GROUP) -> tuple[str, int]:
    """Worker: mark a job delivered from `queue` ('' = the default loose queue) running. Returns (status,
    attempts): run it only if 'running'."""
    status, attempts = _run(r, START_JOB, [keys.job(job_id), queue or keys.queue()],
                            [group, entry_id, worker, now or time.time()])
    return _s(status), int(attempts)


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
) -> int:
    """End a job (worker side): 1 ended now, 0 was already terminal (left as is), -1 no record.

    The stream entry (entry_id in `queue`, '' = the default loose queue; no entry_id: the record's own) is
    acked and deleted in every case. `r` may be a pipeline (then the return value
    comes from pipe.execute()). result_ttl is only the fallback for records written without one.
    """
    if isinstance(result, JobResult):
        result = result.model_dump_json()
    elif isinstance(result, dict):
        result = JobResult.model_validate(result).model_dump_json()
    status = JobStatus(status)
    out = _run(r, FINISH_JOB, [keys.job(job_id), queue or keys.queue(), keys.events, keys.cancel],
               [group, entry_id, job_id, status.value, result or "", error or "", error_code or "",
                now or time.time(), result_ttl, keys.ns, EVENTS_MAXLEN])
    return out if not isinstance(out, int | bytes | str) else int(out)


def cancel_job(r: redis.Redis, keys: Keys, job_id: str, now: float | None = None,
               result_ttl: int = DEFAULT_RESULT_TTL, group: str = GROUP) -> str:
    """'cancelled' | 'cancelling' | the job's terminal status | '' (no such job)."""
    out = _run(r, CANCEL_JOB, [keys.job(job_id), keys.jobs, keys.events, keys.cancel],
               [group, job_id, now or time.time(), result_ttl, keys.ns, EVENTS_MAXLEN])
    return _s(out)


def submit_args(keys: Keys, job: PendingJob, now: float, max_queue_len: int, result_ttl: int,
                group: str = GROUP) -> tuple[list[str], list[Any]]:
    """(KEYS, ARGV) of SUBMIT_JOB for one job."""
    return ([keys.job(job.job_id), keys.queue(job.priority, job.batch_id), keys.registry(job.priority)],
            [job.job_id, job.request_json, now, max_queue_len, result_ttl, job.batch_id, job.custom_id,
             job.priority, keys.ns, group])


def queue_depth(r: redis.Redis, keys: Keys) -> int:
    """Entries in every queue of the namespace: what max_queue_len bounds."""
    return int(_run(r, QUEUE_DEPTH, [], [keys.ns]))


def queue_streams(r: redis.Redis, keys: Keys) -> dict[str, list[str]]:
    """priority -> its queues' stream keys (loose queue first, then its batches; default also {ns}:jobs)."""
    pipe = r.pipeline(transaction=False)
    for p in PRIORITIES:
        pipe.zrange(keys.registry(p), 0, -1)
    out: dict[str, list[str]] = {}
    for p, members in zip(PRIORITIES, pipe.execute(), strict=True):
        legacy = [keys.jobs] if p == Priority.default else []
        out[p.value] = [keys.queue(p), *legacy, *(_s(m) for m in members)]
    return out


def queue_totals(r: redis.Redis, keys: Keys) -> tuple[int, int]:
    """(entries in every queue, entries delivered to a worker and not yet acknowledged)."""
    streams = [q for qs in queue_streams(r, keys).values() for q in qs]
    pipe = r.pipeline(transaction=False)
    for q in streams:
        pipe.xlen(q).xpending(q, GROUP)
    replies = pipe.execute(raise_on_error=False)  # a queue without a group (or stream) answers an error
    for reply in replies:
        if isinstance(reply, redis.ConnectionError | redis.TimeoutError):
            raise reply
    depth = sum(n for n in replies[::2] if isinstance(n, int))
    pending = sum(int(p["pending"]) for p in replies[1::2] if isinstance(p, dict))
    return depth, pending


def ensure_group(r: redis.Redis, stream: str, group: str = GROUP) -> None:
    """Create the consumer group on `stream` at id 0 (so no entry written before it is skipped); a no-op if it
    exists."""
    try:
        r.xgroup_create(stream, group, id="0", mkstream=True)
    except redis.ResponseError as err:
        if "BUSYGROUP" not in str(err):
            raise
