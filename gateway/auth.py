"""Bearer API keys: who is asking. Every stored object carries its owner id, and only its owner sees it."""

from __future__ import annotations

import hmac

from fastapi import Request

from gateway.errors import APIError
from gateway.settings import owner_id


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
    # Looked up by its hash: the lookup time says nothing about how much of a key was right.
    who = owner_id(key)
    known = request.app.state.ctx.api_keys.get(who)
    if known is None or not hmac.compare_digest(known.encode(), key.encode()):
        raise _unauthorized("Incorrect API key provided. Check the key (the gateway's keys are set by "
                            "TOKENBUS_GATEWAY_API_KEYS).")
    return who
