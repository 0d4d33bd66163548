"""The service's own routes: /healthz (no key: does Redis answer?) and /openapi.json (the schema, behind the key)."""

from __future__ import annotations

import asyncio
from typing import Any

import anyio.to_thread
import redis
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


def saturation(ctx) -> dict[str, dict[str, int]]:
    """How full each pool every request draws on is: streams (live/quotas.py), the threads of blocking calls,
    the shared Redis pool's connections (a Sentinel or cluster client has no bounded pool: not reported)."""
    threads = anyio.to_thread.current_default_thread_limiter()
    pools = {"streams": {"busy": ctx.quotas.streams_open, "limit": ctx.quotas.max_streams_total},
             "threads": {"busy": int(threads.borrowed_tokens), "limit": int(threads.total_tokens)}}
    pool = ctx.redis.connection_pool
    if isinstance(pool, redis.BlockingConnectionPool):
        # its queue holds one slot (a connection or None) per connection not handed out
        pools["redis_connections"] = {"busy": pool.max_connections - pool.pool.qsize(), "limit": pool.max_connections}
    return pools


@router.get("/healthz")
async def healthz(request: Request) -> dict[str, Any]:
    """No key needed: 200 while Redis answers (compose's healthcheck), 503 otherwise. The answer says how full
    the gateway's pools are; `status` is "saturated" (still 200: restarting would not help) while one is full.
    `?ready=1` (a readiness probe) answers 503 then, so a balancer sends new requests elsewhere."""
    try:
        await request.app.state.health.ping()
    except Exception as err:
        log.warning("healthz_redis_error", error=str(err))  # the log has why; the public answer does not
        raise APIError(503, "Redis does not answer", code="redis_unavailable") from None
    pools = saturation(request.app.state.ctx)
    full = sorted(name for name, p in pools.items() if p["busy"] >= p["limit"])
    if full and request.query_params.get("ready") in ("1", "true"):
        raise APIError(503, f"saturated: {', '.join(full)} all in use", code="saturated")
    return {"status": "saturated" if full else "ok", "saturated": full, **pools}


@router.get("/openapi.json")
async def openapi(request: Request, _who: str = Depends(owner)) -> dict[str, Any]:
    return request.app.openapi()
