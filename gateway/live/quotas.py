"""Per-key admission: concurrent interactive requests and streams, and queued jobs and tokens, answered 429.

One tenant holding 24 completions in flight starved another's batch, and 120 streams from one key took the
gateway down (issue #22): nothing bounded one key's share. Each /v1/chat/completions or /v1/completions call
takes a lease here before its job is queued and gives it back when the answer is sent (or the client goes);
a lease also lapses after its deadline, so a lost release cannot lock a key out. The counts are per gateway
process: with R replicas a key may hold up to R times the limits (docs/gateway.md).

Every long-lived connection takes a stream lease: an API `stream: true` completion and a dashboard token stream
alike draw on the key's one max_streams, and all keys' on the process's max_streams_total (503 past it), so
400 dashboard streams of one key no longer hold the threads and connections others need (issue #34).
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass

from gateway.errors import APIError


@dataclass(frozen=True)
class Lease:
    owner: str
    lease_id: int
    stream: bool
    tokens: int
    deadline: float


class KeyQuotas:
    def __init__(self, max_requests: int, max_streams: int, max_tokens: int, retry_after_s: int = 2,
                 max_streams_total: int = 2048) -> None:
        self.max_requests, self.max_streams, self.max_tokens = max_requests, max_streams, max_tokens
        self.retry_after_s, self.max_streams_total = retry_after_s, max_streams_total
        self._leases: dict[str, dict[int, Lease]] = {}
        self._streams = 0  # stream leases of every key (lapsed ones included until _lapse drops them)
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def _lapse(self, owner: str, now: float) -> dict[int, Lease]:
        held = self._leases.setdefault(owner, {})
        for lid in [lid for lid, lease in held.items() if lease.deadline < now]:
            self._streams -= held.pop(lid).stream
        return held

    def acquire(self, owner: str, stream: bool, tokens: int, hold_s: float) -> Lease:
        """A lease for one interactive request or stream, or a 429 APIError naming the key's limit it would pass
        (503 when this process's streams are all taken)."""
        now = time.monotonic()
        with self._lock:
            held = self._lapse(owner, now)
            if stream and self._streams >= self.max_streams_total:
                for other in list(self._leases):  # rare: only when full, drop every key's lapsed leases
                    self._lapse(other, now)
                if self._streams >= self.max_streams_total:
                    raise APIError(503, f"this gateway holds {self._streams} streams, its limit max_streams = "
                                        f"{self.max_streams_total}; retry in a while, or send the work as a batch",
                                   code="streams_full", headers={"retry-after": str(self.retry_after_s)})
            streams = sum(1 for lease in held.values() if lease.stream)
            queued_tokens = sum(lease.tokens for lease in held.values())
            if len(held) >= self.max_requests:
                raise self._refuse(f"{len(held)} requests of this key are in flight, the limit "
                                   f"max_requests_per_key = {self.max_requests}")
            if stream and streams >= self.max_streams:
                raise self._refuse(f"{streams} streams of this key are open, the limit max_streams_per_key = "
                                   f"{self.max_streams}")
            if tokens > self.max_tokens:  # never fits, so no retry helps: 400 (a key's first call was let through)
                raise APIError(400, f"this request may cost {tokens} tokens (prompt + max_tokens x n), more than "
                                    f"one key may have in flight (max_tokens_per_key = {self.max_tokens}); lower "
                                    "max_tokens or n, or send the work as a batch (/v1/batches)",
                               param="max_tokens", code="tokens_per_key_exceeded")
            if queued_tokens + tokens > self.max_tokens:
                raise self._refuse(f"this key's requests in flight may generate {queued_tokens} tokens; "
                                   f"{tokens} more would pass the limit max_tokens_per_key = {self.max_tokens}")
            lease = Lease(owner, next(self._ids), stream, tokens, now + hold_s)
            held[lease.lease_id] = lease
            self._streams += stream
            return lease

    def release(self, lease: Lease | None) -> None:
        """Give a lease back (idempotent)."""
        if lease is None:
            return
        with self._lock:
            held = self._leases.get(lease.owner)
            if held is not None:
                if held.pop(lease.lease_id, None) is not None:
                    self._streams -= lease.stream
                if not held:
                    del self._leases[lease.owner]

    def held(self, owner: str) -> int:
        with self._lock:
            return len(self._leases.get(owner, {}))

    @property
    def streams_open(self) -> int:
        """Stream leases of every key (what /healthz reports against max_streams_total)."""
        with self._lock:
            return self._streams

    def _refuse(self, why: str) -> APIError:
        return APIError(429, f"too many requests for this API key: {why}; wait for some to finish, or send "
                             "bulk work as a batch (/v1/batches)", code="rate_limit_exceeded",
                        headers={"retry-after": str(self.retry_after_s)})


