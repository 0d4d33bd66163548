"""Request size limits (413) as ASGI middleware: by Content-Length up front, and by counting the bytes read.

Uploads (the API's POST /v1/files and the dashboard's batch form, POST /ui/batches: both stream the file to disk,
files/upload.py) get their own (large) limit; every other body the small JSON one. Counting while reading also
covers chunked uploads that send no Content-Length. Before answering 413 the rest of the body is read and
dropped (up to DRAIN_CAP), because an HTTP client still sending would otherwise see a reset connection
instead of the 413.

Slow bodies (slowloris on the body): after grace_s the bytes received must keep up with min_rate bytes/s
on average; a body that falls behind gets 408 and its connection closed. Slow headers are cut by the
HTTP protocol itself (server.py), before any ASGI code runs.
"""

from __future__ import annotations

import asyncio
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import APIError, too_large

DRAIN_CAP = 64 * 1024 * 1024
UPLOAD_PATHS = ("/v1/files", "/ui/batches")  # the routes whose body is a file (files/upload.py receive_upload)


class BodyLimit:
    def __init__(self, app: ASGIApp, *, max_body: int, max_upload: int,
                 upload_paths: tuple[str, ...] = UPLOAD_PATHS, grace_s: float = 10.0,
                 min_rate: int = 16 * 1024) -> None:
        self.app, self.max_body, self.max_upload, self.upload_paths = app, max_body, max_upload, upload_paths
        self.grace_s, self.min_rate = grace_s, min_rate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        upload = scope["method"] == "POST" and scope["path"].rstrip("/") in self.upload_paths
        limit, what = (self.max_upload, "the upload") if upload else (self.max_body, "the request body")
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            if int(declared) <= limit + DRAIN_CAP:
                await _drain(receive, DRAIN_CAP)
            await too_large(limit, what).response()(scope, receive, send)
            return
        seen, started, done = 0, time.monotonic(), False

        async def counted() -> Message:
            nonlocal seen, done
            if done:  # the body is read: what is left is waiting for a disconnect, which has no deadline
                return await receive()
            # By when the next bytes must come: grace_s, plus the time min_rate allows for what came so far.
            left = started + self.grace_s + seen / self.min_rate - time.monotonic()
            try:
                message = await asyncio.wait_for(receive(), max(left, 0.001))
            except TimeoutError:
                raise APIError(408, f"the request body came too slowly ({seen} bytes in "
                                    f"{time.monotonic() - started:.0f} s; this gateway wants {self.min_rate} "
                                    f"bytes/s after the first {self.grace_s:g} s)", code="request_timeout",
                               headers={"connection": "close"}) from None
            if message["type"] == "http.request" and not message.get("more_body", False):
                done = True
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    if message.get("more_body", False):
                        await _drain(receive, DRAIN_CAP)
                    raise too_large(limit, what)
            return message

        await self.app(scope, counted, send)


async def _drain(receive: Receive, cap: int) -> None:
    dropped = 0
    while dropped <= cap:
        message = await receive()
        if message["type"] != "http.request":
            return
        dropped += len(message.get("body", b""))
        if not message.get("more_body", False):
            return
