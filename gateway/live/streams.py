"""StreamHub: every `stream: true` request of the gateway reads its tokens through one thread.

Client.stream in a thread per request held a thread and a pooled Redis connection per waiting stream:
120 streams emptied the 100-connection pool and every tenant, /healthz too, got 503 (issue #22). Here one
thread XREADs the token streams ({ns}:job:{id}:tokens) of all open subscriptions at once, on its own
connection, and hands each request its chunks through an asyncio queue. A waiting stream holds neither a
thread nor a connection; new subscriptions join the next read (at most BLOCK_MS later).

Every job that asked for a stream ends it with a done chunk, however it ends (docs/protocol.md, "How a token
stream ends"); one that ends without (its record gone, or written by an older worker) is noticed every RESYNC_S
from its record, and its subscription then ends with END after one last read of its stream.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field

import redis
import structlog

from gateway.live.background import Background
from producer.client import TokenChunk
from protocol.connection import redis_from_url
from protocol.keys import Keys
from protocol.models import TERMINAL_STATUSES

log = structlog.get_logger("tokenbus.gateway")
BLOCK_MS = 100
RESYNC_S = 1.0
END = None  # what a subscription's queue gets when its job ended without a done chunk


@dataclass(eq=False)
class Subscription:
    job_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    last_id: str = "0-0"
    next_offset: int = 0
    closed: bool = False

    def put(self, item: TokenChunk | None) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class StreamHub(Background):
    thread_name = "stream-hub"

    def __init__(self, redis_url: str, keys: Keys) -> None:
        # Its own connection: never one of the shared pool's, whatever the other requests do.
        self.redis = redis_from_url(redis_url, decode_responses=True, socket_timeout=30,
                                          socket_connect_timeout=5, max_connections=2,
                                          encoding_errors="replace")
        self.keys = keys
        self._subs: dict[str, list[Subscription]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        super().__init__()

    def _interrupt(self) -> None:
        self._wake.set()

    def _close(self) -> None:
        self.redis.close()

    def open(self, job_id: str) -> Subscription:
        """Subscribe to a job's token stream (call from the event loop)."""
        self.start()
        sub = Subscription(job_id, asyncio.get_running_loop())
        with self._lock:
            self._subs.setdefault(job_id, []).append(sub)
        self._wake.set()
        return sub

    def close(self, sub: Subscription) -> None:
        sub.closed = True
        with self._lock:
            rest = [s for s in self._subs.get(sub.job_id, []) if s is not sub]
            if rest:
                self._subs[sub.job_id] = rest
            else:
                self._subs.pop(sub.job_id, None)

    @property
    def open_count(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._subs.values())

    # ---- the thread ---------------------------------------------------------------------------------

    def _run(self) -> None:
        next_resync = time.monotonic() + RESYNC_S
        while not self._stop.is_set():
            with self._lock:
                subs = {jid: list(v) for jid, v in self._subs.items()}
            if not subs:
                self._wake.wait(1.0)
                self._wake.clear()
                continue
            try:
                self._read(subs, BLOCK_MS)
                if time.monotonic() >= next_resync:
                    next_resync = time.monotonic() + RESYNC_S
                    self._end_finished(subs)
            except redis.RedisError as err:
                log.warning("stream_hub_redis_error", error=str(err))
                self._stop.wait(0.5)
            except Exception:  # keep serving every other stream
                log.exception("stream_hub_error")
                self._stop.wait(0.5)

    def _read(self, subs: dict[str, list[Subscription]], block: int | None) -> None:
        # One position per job: the subscriptions of one job (rare: two requests) read from the oldest.
        job_of = {self.keys.tokens(jid): jid for jid in subs}
        streams = {key: min((s.last_id for s in subs[jid]), key=_id_key) for key, jid in job_of.items()}
        resp = self.redis.xread(streams, count=100, block=block)
        for key, entries in resp or []:
            for sub in subs.get(job_of.get(key, ""), []):
                self._deliver(sub, entries)

    def _deliver(self, sub: Subscription, entries: list) -> None:
        for entry_id, fields in entries:
            if _id_key(entry_id) <= _id_key(sub.last_id):
                continue
            sub.last_id = entry_id
            offset, token_ids = int(fields["offset"]), json.loads(fields["token_ids"])
            if offset + len(token_ids) <= sub.next_offset and token_ids:
                continue  # re-sent after a worker's Redis outage
            sub.next_offset = offset + len(token_ids)
            sub.put(TokenChunk(offset=offset, token_ids=token_ids, text=fields.get("text", ""),
                               done=fields.get("done") == "1"))

    def _end_finished(self, subs: dict[str, list[Subscription]]) -> None:
        """End the subscriptions of jobs whose record has ended, after reading their streams once more."""
        ids = sorted(subs)
        pipe = self.redis.pipeline(transaction=False)
        for jid in ids:
            pipe.hget(self.keys.job(jid), "status")
        ended = {jid: subs[jid] for jid, status in zip(ids, pipe.execute(), strict=True)
                 if status is None or status in TERMINAL_STATUSES}
        if not ended:
            return
        self._read(ended, None)  # the worker wrote the last chunk before the end: read it first
        for group in ended.values():
            for sub in group:
                sub.put(END)
                self.close(sub)


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)
