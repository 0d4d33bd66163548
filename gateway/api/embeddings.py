"""POST /v1/embeddings: one embedding job (protocol/embeddings.py), waited for, answered in OpenAI's shape.

The body maps to a job exactly as a batch line's /v1/embeddings body does (producer.openai_batch); the vectors
are read back as the raw bytes the worker stored and rendered as floats or base64 (`encoding_format`). The job
id is in the `x-tokenbus-job-id` header, as for completions.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from gateway.api.completions import submit
from gateway.auth import owner
from gateway.errors import APIError, invalid
from gateway.http import get_ctx, json_body
from gateway.jobs import job_error
from gateway.live.waiter import ClientGone
from producer import vectors
from producer.batch_file import request_tokens
from producer.openai_batch import EMBEDDINGS, body_request
from protocol.errors import InvalidJob
from protocol.models import JobStatus

router = APIRouter()


@router.post("/v1/embeddings")
async def embeddings(request: Request, who: str = Depends(owner)) -> Any:
    ctx = get_ctx(request)
    body = await json_body(request)
    try:
        job_request = body_request(EMBEDDINGS, body)
    except InvalidJob as err:
        message = str(err).removeprefix("body: ").removeprefix("body.")
        param = message.split(":", 1)[0] if ":" in message.split(" ", 1)[0] else None
        raise invalid(message, param=param) from None
    timeout = ctx.settings.completion_timeout_s
    lease = ctx.quotas.acquire(who, False, request_tokens(job_request), hold_s=timeout + 60)
    try:
        job_id = await run_in_threadpool(submit, ctx, who, EMBEDDINGS, job_request)
        job = await ctx.waiter.wait(job_id, timeout, request.is_disconnected)
    except ClientGone:
        ctx.cancels.cancel(job_id)
        return JSONResponse({}, status_code=499)
    finally:
        ctx.quotas.release(lease)
    headers = {"x-tokenbus-job-id": job_id}
    if job is None:
        raise APIError(504, f"job {job_id} did not finish within {timeout:g} s; it is still running: poll "
                            f"GET /v1/jobs/{job_id}", code="timeout", headers=headers)
    if job.status != JobStatus.finished or job.result is None:
        err = job_error(job)
        err.headers = headers
        raise err
    blob = await run_in_threadpool(lambda: vectors.read_blobs(ctx.client.redis, ctx.client.keys, [job_id])[0])
    return JSONResponse(vectors.embeddings_response(job, blob), headers=headers)
