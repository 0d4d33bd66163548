"""POST /v1/embeddings: one embedding job (protocol/embeddings.py), waited for, answered in OpenAI's shape.

The body maps to a job exactly as a batch line's /v1/embeddings body does (producer.openai_batch); the vectors
are read back as the raw bytes the worker stored and rendered as floats or base64 (`encoding_format`). The job
id is in the `x-tokenbus-job-id` header; a timeout or a client gone cancels the job, as for completions.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from gateway.api.completions import invalid_body, leased_submit, wait_finished
from gateway.auth import owner
from gateway.http import get_ctx, json_body
from producer import vectors
from producer.openai_batch import EMBEDDINGS, body_request
from protocol.errors import InvalidJob

router = APIRouter()


@router.post("/v1/embeddings")
async def embeddings(request: Request, who: str = Depends(owner)) -> Any:
    ctx = get_ctx(request)
    body = await json_body(request)
    try:
        job_request = body_request(EMBEDDINGS, body)
    except InvalidJob as err:
        raise invalid_body(err) from None
    timeout = ctx.settings.completion_timeout_s
    kept, lease = await leased_submit(ctx, who, EMBEDDINGS, job_request, timeout)
    job_id = kept.job_id
    job = await wait_finished(ctx, request, kept, lease, timeout)
    if isinstance(job, JSONResponse):
        return job
    blob = await run_in_threadpool(lambda: vectors.read_blobs(ctx.client.redis, ctx.client.keys, [job_id])[0])
    return JSONResponse(vectors.embeddings_response(job, blob), headers={"x-tokenbus-job-id": job_id})
