"""The dashboard's pages (GET). Each page's live part is a fragment (?fragment=1) that htmx polls."""

from __future__ import annotations

import asyncio
import json
import time
import weakref
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from gateway.errors import APIError
from gateway.http import get_ctx
from gateway.jobs import job_object, owned_job
from gateway.live.streams import END
from gateway.ui import data, samples
from gateway.ui.render import HEADERS, Current, page

router = APIRouter(prefix="/ui", include_in_schema=False)
TOKENS_STREAM_S = 300  # a job page's token stream ends after this (the page then shows the record's text)


def _view(name: str, fragment: bool) -> str:
    return f"fragments/{name}" if fragment else name


@router.get("", response_class=HTMLResponse)
@router.get("/", response_class=HTMLResponse)
async def overview(request: Request, sess: Current, fragment: bool = False) -> HTMLResponse:
    ctx = get_ctx(request)

    def read() -> dict[str, Any]:
        info = ctx.client.info()
        samples.record(ctx, info)
        alive = [w for w in info.workers if w.alive]
        return {"info": info, "alive": len(alive), "batches": ctx.redis.zcard(ctx.gkeys.batches(sess.owner)),
                "series": samples.series(ctx), "models": data.models(info, samples.model_rates(ctx))}

    values = await run_in_threadpool(read)
    s = values["series"]
    values["jobs_s"] = s["jobs_s"][-1] if s["t"] else 0.0
    values["tokens_s"] = s["tokens_s"][-1] if s["t"] else 0.0
    return await page(_view("overview.html", fragment), request, sess, active="overview", **values)


@router.get("/api/series")
async def series(request: Request, sess: Current) -> JSONResponse:
    """The overview charts' columns (the charts' script polls this)."""
    return JSONResponse(await run_in_threadpool(samples.series, get_ctx(request)), headers=HEADERS)


@router.get("/batches", response_class=HTMLResponse)
async def batches(request: Request, sess: Current,
                  page_no: int = Query(0, alias="page", ge=0, le=1_000_000),
                  fragment: bool = False) -> HTMLResponse:
    rows, total = await run_in_threadpool(data.batches_page, get_ctx(request), sess.owner, page_no)
    pages = max(1, -(-total // data.PAGE))
    return await page(_view("batches.html", fragment), request, sess, active="batches", rows=rows, total=total,
                page_no=page_no, pages=pages)


@router.get("/batches/{batch_id}", response_class=HTMLResponse)
async def batch(batch_id: str, request: Request, sess: Current,
                page_no: int = Query(0, alias="page", ge=0, le=10_000_000),
                fragment: bool = False) -> HTMLResponse:
    ctx = get_ctx(request)

    def read() -> dict[str, Any] | None:
        row = data.owned_batch(ctx, sess.owner, batch_id)
        if row is None:
            return None
        jobs, njobs = data.batch_jobs(ctx, batch_id, page_no)
        return {"row": row, "jobs": jobs, "njobs": njobs,
                "failed_lines": data.file_lines(ctx, sess.owner, row.obj["error_file_id"])}

    values = await run_in_threadpool(read)
    if values is None:
        return await page("missing.html", request, sess, 404, what="batch", id=batch_id)
    pages = max(1, -(-values["njobs"] // data.PAGE))
    return await page(_view("batch.html", fragment), request, sess, active="batches", page_no=page_no, pages=pages,
                **values)


@router.get("/files/{file_id}")
async def file_content(file_id: str, request: Request, sess: Current):
    """A batch's output or error file, for its owner (the API's GET /v1/files/{id}/content, by session)."""
    from fastapi.responses import FileResponse

    ctx = get_ctx(request)
    meta = await run_in_threadpool(ctx.files.find, sess.owner, file_id)
    if meta is None or not ctx.files.path(meta.id).is_file():
        return await page("missing.html", request, sess, 404, what="file", id=file_id)
    return FileResponse(ctx.files.path(meta.id), media_type="application/jsonl", filename=meta.filename,
                        content_disposition_type="attachment", headers=HEADERS)


@router.get("/workers", response_class=HTMLResponse)
async def workers(request: Request, sess: Current, fragment: bool = False) -> HTMLResponse:
    info = await run_in_threadpool(get_ctx(request).client.info)
    return await page(_view("workers.html", fragment), request, sess, active="workers", rows=data.workers(info))


@router.get("/dead", response_class=HTMLResponse)
async def dead(request: Request, sess: Current,
               before: str | None = Query(None, pattern=r"^\d{1,20}-\d{1,20}$")) -> HTMLResponse:
    rows, total, more = await run_in_threadpool(data.dead_letters, get_ctx(request), before,
                                                None if sess.operator else sess.owner)
    return await page("dead.html", request, sess, active="dead", rows=rows, total=total, more=more, before=before)


@router.get("/jobs", response_class=HTMLResponse)
async def job_lookup(request: Request, sess: Current, id: str = "") -> HTMLResponse:
    """The navigation's "job by id" form lands here: to the job's page, or a form saying what was wrong."""
    from fastapi.responses import RedirectResponse

    job_id = id.strip()
    if job_id and data.valid_job_id(job_id):
        return RedirectResponse(f"/ui/jobs/{job_id}", status_code=303)
    return await page("job_lookup.html", request, sess, active="job", id=job_id)


@router.get("/jobs/{job_id}", response_class=HTMLResponse)
async def job(job_id: str, request: Request, sess: Current, fragment: bool = False):
    ctx = get_ctx(request)
    try:
        found, endpoint = await run_in_threadpool(owned_job, ctx, sess.owner, job_id)
    except APIError:
        return await page("missing.html", request, sess, 404, what="job", id=job_id)
    obj = job_object(found, endpoint)
    return await page(_view("job.html", fragment), request, sess, active="job", job=found, obj=obj,
                streamed=bool(found.request and found.request.get("stream")))


@router.get("/jobs/{job_id}/tokens")
async def job_tokens(job_id: str, request: Request, sess: Current) -> Response:
    """Server-sent events: the job's tokens as its worker publishes them (`token` events), then `end`.

    Read through the StreamHub like an API stream (no thread, no pooled connection while it waits), under a
    stream lease of the key's one budget (live/quotas.py): 429 past the key's streams, 503 past the process's."""
    ctx = get_ctx(request)
    try:
        await run_in_threadpool(owned_job, ctx, sess.owner, job_id)
    except APIError:
        return JSONResponse({"error": "no such job"}, status_code=404, headers=HEADERS)
    try:
        lease = ctx.quotas.acquire(sess.owner, stream=True, tokens=0, hold_s=TOKENS_STREAM_S + 60)
    except APIError as err:
        return JSONResponse(err.body(), status_code=err.status, headers=HEADERS | (err.headers or {}))

    async def events() -> AsyncIterator[str]:
        started = time.monotonic()
        sub = ctx.streams.open(job_id)
        try:
            while (left := started + TOKENS_STREAM_S - time.monotonic()) > 0:
                try:
                    chunk = await asyncio.wait_for(sub.queue.get(), left)
                except TimeoutError:
                    break
                if chunk is END:
                    break
                if chunk.text:
                    yield f"event: token\ndata: {json.dumps(chunk.text)}\n\n"
                if chunk.done:
                    break
            yield f"event: end\ndata: {json.dumps(round(time.monotonic() - started, 3))}\n\n"
        finally:
            ctx.streams.close(sub)
            ctx.quotas.release(lease)

    stream = events()
    weakref.finalize(stream, ctx.quotas.release, lease)  # a client gone before the first chunk: never started
    return StreamingResponse(stream, media_type="text/event-stream", headers=HEADERS | {"x-accel-buffering": "no"})
