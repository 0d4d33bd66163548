"""/v1/batches: create (with Idempotency-Key), list, retrieve, cancel, and the tokenbus extension retry (thin:
the work is in batches/service.py and batches/retry.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool

from gateway import idempotency
from gateway.auth import owner
from gateway.batches import retry
from gateway.batches import service as batch_service
from gateway.context import GatewayContext
from gateway.http import get_ctx, json_body

router = APIRouter()


@router.post("/v1/batches")
async def create_batch(request: Request, who: str = Depends(owner)) -> dict[str, Any]:
    client_key = idempotency.header_key(request)
    body = await json_body(request)
    req = batch_service.parse_create(body)
    ctx = get_ctx(request)
    if client_key is None:
        return await run_in_threadpool(batch_service.create, ctx, who, req)
    body_digest = idempotency.digest(json.dumps(body, sort_keys=True).encode())
    return await run_in_threadpool(once, ctx, who, client_key, body_digest, "batches",
                                   lambda: batch_service.create(ctx, who, req))


def once(ctx: GatewayContext, who: str, client_key: str, body_digest: str, route: str,
         make: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """make() the batch unless this Idempotency-Key made one already: then that batch, as it is now."""
    claim = idempotency.claim(ctx.redis, ctx.gkeys, route, who, client_key, body_digest)
    if claim.earlier is not None:
        return batch_service.retrieve(ctx, who, claim.earlier)
    try:
        made = make()
    except BaseException:
        claim.release()  # nothing was made: the same request may be sent again
        raise
    claim.settle(made["id"])
    return made


@router.post("/v1/batches/{batch_id}/retry")
async def retry_batch(batch_id: str, request: Request, who: str = Depends(owner)) -> dict[str, Any]:
    """tokenbus extension: a new batch of the failed, expired and cancelled lines of an ended one."""
    ctx = get_ctx(request)
    client_key = idempotency.header_key(request)
    if client_key is None:
        return await run_in_threadpool(retry.retry_batch, ctx, who, batch_id)
    return await run_in_threadpool(once, ctx, who, client_key, idempotency.digest(batch_id.encode()), "retry",
                                   lambda: retry.retry_batch(ctx, who, batch_id))


@router.get("/v1/batches")
async def list_batches(request: Request, who: str = Depends(owner), after: str | None = None,
                       limit: int = 20) -> dict[str, Any]:
    return await run_in_threadpool(batch_service.list_page, get_ctx(request), who, after, limit)


@router.get("/v1/batches/{batch_id}")
async def retrieve_batch(batch_id: str, request: Request, who: str = Depends(owner)) -> dict[str, Any]:
    return await run_in_threadpool(batch_service.retrieve, get_ctx(request), who, batch_id)


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, request: Request, who: str = Depends(owner)) -> dict[str, Any]:
    return await run_in_threadpool(batch_service.cancel, get_ctx(request), who, batch_id)
