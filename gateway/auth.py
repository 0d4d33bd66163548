"""Bearer API keys: who is asking. Every stored object carries its owner id, and only its owner sees it. Wrong
keys are throttled per client address and per key (throttle.py)."""

from __future__ import annotations

import hmac

from fastapi import Request

from gateway.errors import APIError
from gateway.settings import owner_id
from gateway.throttle import client_of, key_of


def _unauthorized(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key", headers={"www-authenticate": "Bearer"})


def owner(request: Request) -> str:
    """FastAPI dependency: the caller's owner id, or 401. Runs before any request body is read."""
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise _unauthorized("You didn't provide an API key. Send it in the Authorization header: "
                            "'Authorization: Bearer YOUR_KEY' (the keys are set by TOKENBUS_GATEWAY_API_KEYS).")
    key = key.strip()
    ctx = request.app.state.ctx
    # Looked up by its hash: the lookup time says nothing about how much of a key was right.
    who = owner_id(key)
    names = (client_of(request.client.host if request.client else None), key_of(who))
    throttled(ctx.auth_throttle.retry_after(*names))
    known = ctx.api_keys.get(who)
    if known is None or not hmac.compare_digest(known.encode(), key.encode()):
        ctx.auth_throttle.failed(*names)
        raise _unauthorized("Incorrect API key provided. Check the key (the gateway's keys are set by "
                            "TOKENBUS_GATEWAY_API_KEYS).")
    return who


def throttled(retry_after_s: int) -> None:
    """429 while this address or key has used up its wrong tries (before the key is even compared)."""
    if retry_after_s:
        raise APIError(429, f"too many wrong API keys from this address or for this key; try again in "
                            f"{retry_after_s} s", code="too_many_auth_failures",
                       headers={"retry-after": str(retry_after_s)})
