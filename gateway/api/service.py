"""The service's own routes: /healthz (no key: does Redis answer?) and /openapi.json (the schema, behind the key)."""

from __future__ import annotations

import asyncio
from typing import Any

import structlog
from fastapi import APIRouter, Depends, Request

from gateway.auth import owner
from gateway.errors import APIError
from protocol.connection import async_redis_from_url

log = structlog.get_logger("tokenbus.gateway")
router = APIRouter(include_in_schema=False)


class Health:
    """Pings on its own connection, on the event loop: no pool, no thread, so a flood of other requests cannot
    make /healthz fail (compose's healthcheck allows 4 s)."""

    def __init__(self, redis_url: str) -> None:
        self.redis = async_redis_from_url(redis_url, socket_timeout=2, socket_connect_timeout=2)
        self.lock = asyncio.Lock()

    async def ping(self) -> None:
        async with self.lock:
            await asyncio.wait_for(self.redis.ping(), 3.0)

    async def aclose(self) -> None:
        await self.redis.aclose()


@router.get("/healthz")
async def healthz(request: Request) -> dict[str, Any]:
    """No key needed: 200 while Redis answers (compose's healthcheck), 503 otherwise."""
    try:
        await request.app.state.health.ping()
    except Exception as err:
        log.warning("healthz_redis_error", error=str(err))  # the log has why; the public answer does not
        raise APIError(503, "Redis does not answer", code="redis_unavailable") from None
    return {"status": "ok"}


@router.get("/openapi.json")
async def openapi(request: Request, _who: str = Depends(owner)) -> dict[str, Any]:
    return request.app.openapi()
