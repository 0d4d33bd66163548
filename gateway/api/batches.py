"""/v1/batches: create, list, retrieve, cancel (thin: the work is in batches/service.py)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool

from gateway.auth import owner
from gateway.batches import service as batch_service
from gateway.http import get_ctx, json_body

router = APIRouter()


@router.post("/v1/batches")
async def create_batch(request: Request, who: str = Depends(owner)) -> dict[str, Any]:
    req = batch_service.parse_create(await json_body(request))
    return await run_in_threadpool(batch_service.create, get_ctx(request), who, req)


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
