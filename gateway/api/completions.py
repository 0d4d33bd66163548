"""POST /v1/chat/completions and /v1/completions (and, through api/responses.py, /v1/responses): enqueue one job,
wait for it, answer as OpenAI does.

The body is mapped to a job exactly as a batch line's body is (producer.openai_batch.body_request), so the
same request gives the same job either way. `stream: true` answers with server-sent events made from the
job's token stream ({ns}:job:{id}:tokens; live/sse.py, live/responses_sse.py). Every answer carries the job id in
the `x-tokenbus-job-id` header. A call that times out (504) or whose client goes has its job cancelled, and the
key's slot (live/quotas.py) comes back only once that job has really ended (live/cancels.py). The bytes a call
keeps in Redis are reserved against its key before it is queued, and settled once it ends (kept_bytes.py).
"""

from __future__ import annotations

import uuid
import weakref
from typing import Any

import structlog
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from gateway.auth import owner
from gateway.context import GatewayContext
from gateway.errors import APIError, invalid
from gateway.http import get_ctx, json_body
from gateway.jobs import job_error
from gateway.kept_bytes import KeptCall, admit, measure, settle
from gateway.live.responses_sse import ResponsesShape
from gateway.live.sse import ChunkShape, StreamShape, abandon, job_events
from gateway.live.waiter import ClientGone
from producer.batch_file import max_tokens_problem, request_tokens
from producer.openai_batch import CHAT, COMPLETIONS, body_request, response_body
from producer.openai_responses import RESPONSES, UnsupportedParameter
from protocol.errors import InvalidJob
from protocol.models import Job, JobRequest, JobStatus
from protocol.priority import Priority

log = structlog.get_logger("tokenbus.gateway")
router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, who: str = Depends(owner)) -> Any:
    return await complete(request, who, CHAT)


@router.post("/v1/completions")
async def completions(request: Request, who: str = Depends(owner)) -> Any:
    return await complete(request, who, COMPLETIONS)


def _stream_options(body: dict[str, Any]) -> tuple[bool, bool]:
    """Pop the streaming fields a batch line may not have: (stream, include_usage)."""
    stream = body.pop("stream", False)
    options = body.pop("stream_options", None)
    if not isinstance(stream, bool):
        raise invalid(f"stream must be true or false (got {stream!r})", param="stream")
    if options is not None and (not stream or not isinstance(options, dict)):
        raise invalid("stream_options needs stream: true and must be an object", param="stream_options")
    return stream, bool((options or {}).get("include_usage"))


def submit(ctx: GatewayContext, who: str, endpoint: str, request: JobRequest) -> KeptCall:
    job_id = uuid.uuid4().hex
    # the key's priority comes from the gateway's configuration (key_priorities), never from the request
    request = request.model_copy(update={"priority": Priority(ctx.priorities.get(who, Priority.interactive))})
    kept = admit(ctx, job_id, who, endpoint, request)  # its bytes against the key's limit, and its ownership: 429
    try:
        ctx.client.submit_many([request], job_ids=[job_id])  # validated already (body_request): not again
    except BaseException:
        measure(ctx, kept)  # no job was queued: only its ownership record stays counted
        raise
    log.info("gateway_job_submitted", job_id=job_id, endpoint=endpoint, owner=who, stream=request.stream,
             kept_bytes=kept.most)
    return kept


async def complete(request: Request, who: str, endpoint: str) -> Any:
    ctx = get_ctx(request)
    body = await json_body(request)
    stream, include_usage = _stream_options(body)
    try:
        # off the event loop: a big constraint takes a while to check (a 60,000-entry choice took seconds)
        job_request = await run_in_threadpool(body_request, endpoint, body)
    except UnsupportedParameter as err:
        raise invalid(str(err).removeprefix("body."), param=err.param.removeprefix("body."),
                      code="unsupported_parameter") from None
    except InvalidJob as err:
        raise invalid_body(err) from None
    if problem := max_tokens_problem(job_request, ctx.settings.max_tokens_limit):
        raise invalid(problem, param="max_output_tokens" if endpoint == RESPONSES else "max_tokens",
                      code="max_tokens_too_large")
    job_request = job_request.model_copy(update={"stream": stream})
    timeout = ctx.settings.completion_timeout_s
    kept, lease = await leased_submit(ctx, who, endpoint, job_request, timeout)
    job_id = kept.job_id
    headers = {"x-tokenbus-job-id": job_id}
    if stream:
        handled: list[bool] = []  # the generator's finally ran
        shape: StreamShape = ResponsesShape(job_id, job_request.model, body) if endpoint == RESPONSES else \
            ChunkShape(job_id, endpoint, job_request.model, include_usage)
        events = job_events(ctx, job_id, shape, lease, handled, kept)
        # A client gone before the first chunk: the generator may never start, so its finally never runs;
        # when it is dropped unstarted, the same clean-up runs from here.
        weakref.finalize(events, abandon, ctx, job_id, lease, handled)
        return StreamingResponse(events, media_type="text/event-stream",
                                 headers=headers | {"cache-control": "no-cache"})
    job = await wait_finished(ctx, request, kept, lease, timeout)
    if isinstance(job, JSONResponse):
        return job
    return JSONResponse(response_body(job, endpoint), headers=headers)


async def leased_submit(ctx: GatewayContext, who: str, endpoint: str, job_request: JobRequest,
                        timeout: float) -> tuple[KeptCall, Any]:
    """The key's quota lease (429 before anything is queued when it has too much in flight: live/quotas.py),
    then the job queued with its bytes reserved (kept_bytes.py); (the kept call, the lease)."""
    lease = ctx.quotas.acquire(who, job_request.stream, request_tokens(job_request), hold_s=timeout + 60)
    try:
        return await run_in_threadpool(submit, ctx, who, endpoint, job_request), lease
    except BaseException:
        ctx.quotas.release(lease)
        raise


def invalid_body(err: InvalidJob) -> APIError:
    """A body the mapping refused, as OpenAI's 400; `param` names the field when the message starts with it."""
    message = str(err).removeprefix("body: ").removeprefix("body.")
    param = message.split(":", 1)[0] if ":" in message.split(" ", 1)[0] else None
    return invalid(message, param=param)


async def wait_finished(ctx: GatewayContext, request: Request, kept: KeptCall, lease: Any,
                        timeout: float) -> Job | JSONResponse:
    """Wait for a submitted job: the finished job, a 499 once its client has gone (the job cancelled), or its
    HTTP error (504 after `timeout`: cancelled too). The key's quota lease comes back once the job has ended,
    and its reserved bytes are settled to what Redis holds (kept_bytes.settle)."""
    job_id = kept.job_id
    headers = {"x-tokenbus-job-id": job_id}
    try:
        job = await ctx.waiter.wait(job_id, timeout, request.is_disconnected)
    except ClientGone:
        abandon(ctx, job_id, lease, [])  # nobody will read the answer: free the seat (never fails here)
        return JSONResponse({}, status_code=499)
    except BaseException:
        ctx.quotas.release(lease)
        raise
    if job is None:
        # Left queued, the job held a slot nobody counted: a key repeating this held 8 jobs against a
        # limit of 2 (issue #34). The key's slot comes back once the job has really ended.
        abandon(ctx, job_id, lease, [])
        raise APIError(504, f"job {job_id} did not finish within {timeout:g} s, so it was cancelled; ask for "
                            "fewer tokens, or send long work as a batch (/v1/batches)", code="timeout",
                       headers=headers)
    ctx.quotas.release(lease)
    await run_in_threadpool(settle, ctx, kept, job)
    if job.status != JobStatus.finished or job.result is None:
        err = job_error(job)
        err.headers = headers
        raise err
    return job
