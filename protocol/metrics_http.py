"""The /metrics and /healthz HTTP handler's common part, for the worker's endpoint (worker/serve/metrics.py) and
`tokenbus exporter` (producer/exporter.py): one path each, a body with its length, and no access log."""

from __future__ import annotations

from http.server import BaseHTTPRequestHandler

NOT_FOUND = b"not found: try /metrics or /healthz\n"
TEXT = "text/plain; charset=utf-8"


class MetricsHandler(BaseHTTPRequestHandler):
    """A subclass writes do_GET with `self.send_body(...)`; `self.route` is the path without its query."""

    @property
    def route(self) -> str:
        return self.path.split("?", 1)[0]

    def send_body(self, code: int, content_type: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass  # a scrape every few seconds would flood the structured log
