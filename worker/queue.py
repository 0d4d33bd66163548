"""The worker's Redis operations on the jobs stream and job records. Every method is one round trip (or one
pipeline); retrying after a connection error is the caller's business, and every write here is safe to
repeat after an unknown outcome."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import redis

from producer.protocol import EVENTS_MAXLEN, GROUP, Keys
from worker import queue_scripts

# Set on a handed-back entry: past any worker's lease, so the next XAUTOCLAIM anywhere takes it. Not larger:
# the server subtracts it from "now" in ms.
HAND_BACK_IDLE_MS = 10**10


@dataclass
class Entry:
    """One delivered stream entry, fields decoded to str."""

    entry_id: str
    fields: dict[str, str]


@dataclass
class StartResult:
    outcome: str  # "run" | "terminal" | "missing" | "exhausted"
    attempts: int = 0
    status: str = ""  # the terminal status, for "terminal"


@dataclass
class Ending:
    """What the finish script writes for one job."""

    job_id: str
    entry_id: str | None  # None: no stream entry to acknowledge (it is gone already)
    status: str  # "finished" | "failed" | "cancelled"
    result: dict[str, Any] | None = None
    error: str | None = None
    error_code: str | None = None
    first_token_at: float | None = None
    finished_at: float | None = None


class JobQueue:
    def __init__(self, client: redis.Redis, namespace: str, consumer: str, result_ttl_s: int) -> None:
        self.r = client
        self.keys = Keys(namespace)
        self.consumer = consumer
        self.result_ttl_s = result_ttl_s
        self._start = client.register_script(queue_scripts.START)
        self._renew = client.register_script(queue_scripts.RENEW)
        self._hand_back = client.register_script(queue_scripts.HAND_BACK)
        self._finish = client.register_script(queue_scripts.FINISH)

    # ---- intake -------------------------------------------------------------------------------------

    def ensure_group(self) -> None:
        try:
            self.r.xgroup_create(self.keys.jobs, GROUP, id="0", mkstream=True)
        except redis.ResponseError as err:
            if "BUSYGROUP" not in str(err):
                raise

    def read_new(self, count: int, block_ms: int | None) -> list[Entry]:
        try:
            reply = self.r.xreadgroup(GROUP, self.consumer, {self.keys.jobs: ">"}, count=count, block=block_ms)
        except redis.ResponseError as err:
            # The stream or group vanished (FLUSHALL, a Redis restart without persistence): make it again.
            if "NOGROUP" not in str(err):
                raise
            self.ensure_group()
            return []
        entries: list[Entry] = []
        for _stream, items in reply or []:
            entries.extend(_entry(eid, fields) for eid, fields in items)
        return entries

    def claim_lapsed(self, min_idle_ms: int, count: int, cursor: str) -> tuple[str, list[Entry]]:
        """XAUTOCLAIM entries whose lease lapsed (their worker died). Returns (next cursor, entries)."""
        try:
            reply = self.r.xautoclaim(self.keys.jobs, GROUP, self.consumer, min_idle_ms, cursor, count=count)
        except redis.ResponseError as err:
            if "NOGROUP" not in str(err):
                raise
            self.ensure_group()
            return "0-0", []
        next_cursor, items = _str(reply[0]), reply[1]
        # Entries deleted from the stream but still pending come back empty (Redis 7 also drops them from
        # the PEL in the same call); there is nothing to run.
        entries = [_entry(eid, fields) for eid, fields in items if fields]
        return next_cursor, entries

    def start(self, job_id: str, entry_id: str, max_attempts: int) -> StartResult:
        reply = self._start(
            keys=[self.keys.job(job_id), self.keys.jobs],
            args=[GROUP, entry_id, self.consumer, repr(time.time()), max_attempts],
        )
        outcome = _str(reply[0])
        if outcome == "terminal":
            return StartResult(outcome, status=_str(reply[1]))
        if outcome in ("run", "exhausted"):
            return StartResult(outcome, attempts=int(reply[1]))
        return StartResult(outcome)

    def ack(self, entry_id: str) -> None:
        """Drop an entry that names no job (nothing else to write)."""
        pipe = self.r.pipeline(transaction=True)
        pipe.xack(self.keys.jobs, GROUP, entry_id)
        pipe.xdel(self.keys.jobs, entry_id)
        pipe.execute()

    # ---- leases -------------------------------------------------------------------------------------

    def renew(self, entry_ids: list[str]) -> list[str]:
        """Renew the leases of entries this worker holds; returns the ids it no longer holds."""
        if not entry_ids:
            return []
        lost = self._renew(keys=[self.keys.jobs], args=[GROUP, self.consumer, *entry_ids])
        return [_str(x) for x in lost]

    def hand_back(self, job_id: str, entry_id: str, count_attempt: bool) -> bool:
        handed = self._hand_back(
            keys=[self.keys.job(job_id), self.keys.jobs],
            args=[GROUP, self.consumer, entry_id, HAND_BACK_IDLE_MS, "0" if count_attempt else "1"],
        )
        return bool(handed)

    def cancel_requests(self) -> set[str]:
        return {_str(x) for x in self.r.smembers(self.keys.cancel)}

    # ---- endings ------------------------------------------------------------------------------------

    def finish_many(self, endings: list[Ending]) -> list[bool]:
        """Write each job's ending + event + XACK atomically (one script per job, one pipeline for all).
        True where this call ended the job; False where it had ended already (left untouched)."""
        pipe = self.r.pipeline(transaction=False)
        for e in endings:
            self._finish(
                keys=[self.keys.job(e.job_id), self.keys.jobs, self.keys.events, self.keys.cancel],
                args=[
                    GROUP,
                    e.entry_id or "",
                    e.job_id,
                    e.status,
                    json.dumps(e.result) if e.result is not None else "",
                    e.error or "",
                    e.error_code or "",
                    repr(e.finished_at or time.time()),
                    repr(e.first_token_at) if e.first_token_at is not None else "",
                    self.result_ttl_s,
                    EVENTS_MAXLEN,
                    self.consumer,
                ],
                client=pipe,
            )
        return [bool(x) for x in pipe.execute()]

    def dead_letter(self, job_id: str, reason: str, attempts: int, request: str) -> None:
        self.r.xadd(
            self.keys.dead,
            {"job_id": job_id, "reason": reason, "attempts": attempts, "request": request, "at": repr(time.time())},
            maxlen=EVENTS_MAXLEN,
            approximate=True,
        )

    def publish_tokens(self, parts: list[tuple[str, list[int], str, bool]], ttl_s: int) -> None:
        """Partial output of streaming jobs: (job_id, new token ids, new text, done) per job."""
        pipe = self.r.pipeline(transaction=False)
        for job_id, token_ids, text, done in parts:
            key = self.keys.job(job_id) + ":tokens"
            pipe.xadd(key, {"token_ids": json.dumps(token_ids), "text": text, "done": int(done)})
            pipe.expire(key, ttl_s)
        pipe.execute()

    # ---- presence -----------------------------------------------------------------------------------

    def heartbeat(self, payload: dict[str, Any], ttl_s: int) -> None:
        pipe = self.r.pipeline(transaction=False)
        pipe.set(self.keys.worker(self.consumer), json.dumps(payload), ex=ttl_s)
        pipe.sadd(self.keys.workers, self.consumer)
        pipe.execute()

    def sign_off(self) -> None:
        self.r.delete(self.keys.worker(self.consumer))

    def queue_depth(self) -> tuple[int, int]:
        """(entries in the stream, delivered but unacknowledged) for the metrics."""
        pipe = self.r.pipeline(transaction=False)
        pipe.xlen(self.keys.jobs)
        pipe.xpending(self.keys.jobs, GROUP)
        depth, pending = pipe.execute()
        return int(depth), int(pending["pending"]) if pending else 0


def _str(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def _entry(entry_id: Any, fields: dict[Any, Any] | None) -> Entry:
    decoded: dict[str, str] = {}
    for k, v in (fields or {}).items():
        decoded[_str(k)] = v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)
    return Entry(_str(entry_id), decoded)
