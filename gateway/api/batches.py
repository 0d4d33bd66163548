"""/v1/batches: create (with Idempotency-Key), list, retrieve, cancel, and the tokenbus extension retry (thin:
the work is in batches/service.py and batches/retry.py)."""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool

from gateway import idempotency
from gateway.auth import owner
from gateway.batches import retry
from gateway.batches import service as batch_service
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
    return await run_in_threadpool(idempotency.once, ctx.redis, ctx.gkeys, "batches", who, client_key, body_digest,
                                   lambda: batch_service.create(ctx, who, req),
                                   lambda earlier: batch_service.retrieve(ctx, who, earlier))


@router.post("/v1/batches/{batch_id}/retry")
async def retry_batch(batch_id: str, request: Request, who: str = Depends(owner)) -> dict[str, Any]:
    """tokenbus extension: a new batch of the failed, expired and cancelled lines of an ended one."""
    ctx = get_ctx(request)
    client_key = idempotency.header_key(request)
    if client_key is None:
        return await run_in_threadpool(retry.retry_batch, ctx, who, batch_id)
    return await run_in_threadpool(idempotency.once, ctx.redis, ctx.gkeys, "retry", who, client_key,
                                   idempotency.digest(batch_id.encode()), lambda: retry.retry_batch(ctx, who, batch_id),
                                   lambda earlier: batch_service.retrieve(ctx, who, earlier))


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
