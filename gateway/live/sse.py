"""A streamed completion's answer: server-sent events made from the job's token stream (read by the StreamHub,
streams.py), OpenAI's chunk shapes, then the record's end; a stream nobody reads any more has its job cancelled."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

import structlog
from starlette.concurrency import run_in_threadpool

from gateway.context import GatewayContext
from gateway.errors import APIError
from gateway.jobs import job_error
from gateway.kept_bytes import KeptCall, settle
from gateway.live.quotas import Lease
from gateway.live.streams import END
from producer.openai_batch import CHAT
from protocol.models import Job, JobStatus

log = structlog.get_logger("tokenbus.gateway")


def _event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


class StreamShape(Protocol):
    """How one endpoint's stream looks: its events around the job's text (ChunkShape; live/responses_sse.py)."""

    def opening(self) -> list[str]: ...
    def delta(self, text: str) -> str: ...
    def error(self, body: dict[str, Any]) -> str: ...
    def closing(self, job: Job) -> list[str]: ...
    def end(self) -> list[str]: ...


class ChunkShape:
    """Chat and text completions' stream: chunk objects, a usage chunk when asked, then [DONE]."""

    def __init__(self, job_id: str, endpoint: str, model: str | None, include_usage: bool) -> None:
        self.chat, self.include_usage = endpoint == CHAT, include_usage
        self.base = {"id": f"chatcmpl-{job_id}" if self.chat else f"cmpl-{job_id}",
                     "object": "chat.completion.chunk" if self.chat else "text_completion",
                     "created": int(time.time()), "model": model or "tokenbus"}

    def chunk(self, text: str | None, finish_reason: str | None, role: bool = False, index: int = 0) -> str:
        if self.chat:
            delta: dict[str, Any] = ({"role": "assistant"} if role else {}) | ({} if text is None else
                                                                               {"content": text})
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return _event(self.base | {"choices": [choice]})

    def opening(self) -> list[str]:
        return [self.chunk("", None, role=True)] if self.chat else []

    def delta(self, text: str) -> str:
        return self.chunk(text, None)

    def error(self, body: dict[str, Any]) -> str:
        return _event(body)

    def closing(self, job: Job) -> list[str]:
        assert job.result is not None
        if job.result.model:
            self.base["model"] = job.result.model
        out = [self.chunk(None, job.result.finish_reason)]
        for c in job.result.choices[1:]:  # the token stream carries choice 0; the others come whole
            out.append(self.chunk(c.text, c.finish_reason, role=self.chat, index=c.index))
        if self.include_usage:
            out.append(_event(self.base | {"choices": [], "usage": job.result.usage.openai()}))
        return out

    def end(self) -> list[str]:
        return ["data: [DONE]\n\n"]


async def job_events(ctx: GatewayContext, job_id: str, shape: StreamShape, lease: Lease | None = None,
                     handled: list[bool] | None = None, kept: KeptCall | None = None) -> AsyncIterator[str]:
    ended = False
    # The hub's thread reads the job's token stream: waiting here holds no thread and no Redis connection.
    sub = ctx.streams.open(job_id)
    try:
        for event in shape.opening():
            yield event
        limit = ctx.settings.completion_timeout_s
        deadline = time.monotonic() + limit
        streamed = ""
        while True:
            try:
                part = await asyncio.wait_for(sub.queue.get(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                # Headers are sent: the error goes in the stream, where the SDKs look for it.
                yield shape.error(APIError(504, f"job {job_id} did not finish within {limit:g} s, so it was "
                                                "cancelled; ask for fewer tokens or use a batch",
                                           code="timeout").body())
                return  # `ended` stays False: the finally below cancels the job
            if part is END:
                break
            if part.text:
                streamed += part.text
                yield shape.delta(part.text)
            if part.done:
                break
        # The done chunk and the record's end are written together by the worker; wait for the record.
        job = await ctx.waiter.wait(job_id, 30.0)
        ended = job is not None
        await run_in_threadpool(settle, ctx, kept, job)  # its bytes kept in Redis, now known (kept_bytes.py)
        if job is None or job.status != JobStatus.finished or job.result is None:
            err = job_error(job) if job is not None else APIError(504, f"job {job_id} did not end", code="timeout")
            yield shape.error(err.body())
        else:
            # A worker run with stream_tokens off publishes nothing: the text then comes in one piece.
            if len(job.result.text) > len(streamed) and job.result.text.startswith(streamed):
                yield shape.delta(job.result.text[len(streamed):])
            for event in shape.closing(job):
                yield event
        for event in shape.end():
            yield event
    finally:
        ctx.streams.close(sub)
        if handled is not None:
            handled.append(True)
        if ended:
            ctx.quotas.release(lease)
        else:  # the client went away (or the stream broke): stop generating for nobody
            abandon(ctx, job_id, lease, [])


def abandon(ctx: GatewayContext, job_id: str, lease: Lease | None, handled: list[bool]) -> None:
    """Cancel a job nobody reads (a stream's or a call's); its lease comes back once the job has ended. Queued
    to the canceller's own connection: cannot fail on the shared pool, and needs no await (after a disconnect
    the task is cancelled, and an await would not run)."""
    if handled:
        return
    ctx.cancels.cancel(job_id, then=lambda: ctx.quotas.release(lease))
    log.info("gateway_job_abandoned_by_client", job_id=job_id)
