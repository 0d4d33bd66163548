"""Idempotency-Key on POST /v1/files and POST /v1/batches (Stripe's and Perplexity's convention): a request
retried with the same key and the same body gets the first request's object, never a second one; the same
key with another body is a 409.

One Redis string per (route, API key, client key) for IDEMPOTENCY_TTL_S (24 h): `{body digest}:{object id}`,
about 100 bytes whatever the key or body size (both are hashed), so no tenant can make Redis hold its bodies.
A claim is one `SET NX GET` (atomic: of two concurrent first requests exactly one creates the object); the
other sees the claim still `pending` (no object id yet) and gets a 409 that says to retry.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import redis
from fastapi import Request

from gateway.errors import APIError, invalid
from gateway.keys import GatewayKeys

HEADER = "idempotency-key"
IDEMPOTENCY_TTL_S = 24 * 3600
MAX_KEY_CHARS = 255


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:32]


def header_key(request: Request) -> str | None:
    """The request's Idempotency-Key, None without one; 400 when it is empty or too long."""
    value = request.headers.get(HEADER)
    if value is None:
        return None
    if not value or len(value) > MAX_KEY_CHARS:
        raise invalid(f"Idempotency-Key must be 1-{MAX_KEY_CHARS} characters (got {len(value)})",
                      param="Idempotency-Key")
    return value


class Claim:
    """One request's hold on its idempotency key: `earlier` is the first request's object id (return that
    object), else this request creates the object and calls settle(its id) or, when it fails, release()."""

    def __init__(self, r: redis.Redis, key: str, body_digest: str, earlier: str | None) -> None:
        self.r, self.key, self.body_digest, self.earlier = r, key, body_digest, earlier

    def settle(self, object_id: str) -> None:
        self.r.set(self.key, f"{self.body_digest}:{object_id}", xx=True, keepttl=True)

    def release(self) -> None:
        """Drop this request's pending claim (and only that: never a settled one), so the request may be sent
        again after a failure that made nothing."""
        with self.r.pipeline() as pipe:
            try:
                pipe.watch(self.key)
                if pipe.get(self.key) == f"{self.body_digest}:":
                    pipe.multi()
                    pipe.delete(self.key)
                    pipe.execute()
            except redis.WatchError:  # changed meanwhile: not ours to drop
                pass


def claim(r: redis.Redis, gkeys: GatewayKeys, route: str, owner: str, client_key: str, body_digest: str,
          object_id: str = "") -> Claim:
    """Claim client_key for this body (object_id: the object exists already, as an upload's file does).
    409 when the key was used with another body, or when its first request is still being answered."""
    key = gkeys.idempotency(route, owner, digest(client_key.encode()))
    old = r.set(key, f"{body_digest}:{object_id}", nx=True, ex=IDEMPOTENCY_TTL_S, get=True)
    if old is None:
        return Claim(r, key, body_digest, None)
    old_digest, _, old_id = old.partition(":")
    if old_digest != body_digest:
        raise APIError(409, f"Idempotency-Key {client_key[:80]!r} was used with a different request body in the "
                            "last 24 h; use a new key for a new request", param="Idempotency-Key",
                       code="idempotency_key_reused")
    if not old_id:
        raise APIError(409, f"the first request with Idempotency-Key {client_key[:80]!r} is still being "
                            "answered; retry in a moment", param="Idempotency-Key", code="idempotency_key_in_use",
                       headers={"retry-after": "1"})
    return Claim(r, key, body_digest, old_id)


def once(r: redis.Redis, gkeys: GatewayKeys, route: str, owner: str, client_key: str, body_digest: str,
         make: Callable[[], dict[str, Any]], replay: Callable[[str], dict[str, Any]]) -> dict[str, Any]:
    """make() the object unless this Idempotency-Key made one already: then replay(its id), the object as it
    is now. A make() that raises releases the key, so the same request may be sent again."""
    held = claim(r, gkeys, route, owner, client_key, body_digest)
    if held.earlier is not None:
        return replay(held.earlier)
    try:
        made = make()
    except BaseException:
        held.release()
        raise
    held.settle(made["id"])
    return made
