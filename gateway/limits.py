"""Request size limits (413) as ASGI middleware: by Content-Length up front, and by counting the bytes read.

Uploads get their own (large) limit; every other body the small JSON one. Counting while reading also
covers chunked uploads that send no Content-Length. Before answering 413 the rest of the body is read and
dropped (up to DRAIN_CAP), because an HTTP client still sending would otherwise see a reset connection
instead of the 413.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import too_large

DRAIN_CAP = 64 * 1024 * 1024


class BodyLimit:
    def __init__(self, app: ASGIApp, *, max_body: int, max_upload: int, upload_path: str = "/v1/files") -> None:
        self.app, self.max_body, self.max_upload, self.upload_path = app, max_body, max_upload, upload_path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        upload = scope["method"] == "POST" and scope["path"].rstrip("/") == self.upload_path
        limit, what = (self.max_upload, "the upload") if upload else (self.max_body, "the request body")
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            if int(declared) <= limit + DRAIN_CAP:
                await _drain(receive, DRAIN_CAP)
            await too_large(limit, what).response()(scope, receive, send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
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
