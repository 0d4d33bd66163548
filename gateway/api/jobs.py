"""/v1/jobs/{id} (tokenbus extension): a job's state and answer, and its cancel (the work is in jobs.py)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool

from gateway.auth import owner
from gateway.http import get_ctx
from gateway.jobs import job_object, owned_job

router = APIRouter()


@router.get("/v1/jobs/{job_id}")
async def get_job(job_id: str, request: Request, who: str = Depends(owner)) -> dict[str, Any]:
    job, endpoint = await run_in_threadpool(owned_job, get_ctx(request), who, job_id)
    return job_object(job, endpoint)


@router.post("/v1/jobs/{job_id}/cancel")
async def cancel_job(job_id: str, request: Request, who: str = Depends(owner)) -> dict[str, Any]:
    ctx = get_ctx(request)
    await run_in_threadpool(owned_job, ctx, who, job_id)
    await run_in_threadpool(ctx.client.cancel, job_id)
    job, endpoint = await run_in_threadpool(owned_job, ctx, who, job_id)
    return job_object(job, endpoint)
