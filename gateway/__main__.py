"""`tokenbus-gateway` (serve: the HTTP API), `tokenbus-gateway tasks` (RQ worker + batch watcher) and
`tokenbus-gateway webhooks` (RQ worker delivering webhooks)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from pydantic import ValidationError

if TYPE_CHECKING:
    from gateway.settings import GatewaySettings


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tokenbus-gateway", description="OpenAI-compatible HTTP gateway for tokenbus. "
                                "Settings come from TOKENBUS_GATEWAY_* variables (docs/gateway.md).")
    sub = p.add_subparsers(dest="command")
    s = sub.add_parser("serve", help="the HTTP API (the default)")
    s.add_argument("--host", help="listen address (TOKENBUS_GATEWAY_HOST)")
    s.add_argument("--port", type=int, help="listen port (TOKENBUS_GATEWAY_PORT)")
    t = sub.add_parser("tasks", help="RQ worker: batch submission, finalisation, webhooks; and the batch watcher")
    t.add_argument("--burst", action="store_true", help="exit when the queue is empty (tests, cron)")
    w = sub.add_parser("webhooks", help="RQ worker delivering batch webhooks (its own queue: a slow receiver "
                                        "delays no submit)")
    w.add_argument("--burst", action="store_true", help="exit when the queue is empty (tests, cron)")
    a = p.parse_args(argv)

    from gateway.settings import GatewaySettings

    try:
        overrides = {k: v for k in ("host", "port") if (v := getattr(a, k, None)) is not None}
        settings = GatewaySettings(**overrides)
    except ValidationError as err:
        print(f"error: invalid gateway settings:\n{err}", file=sys.stderr)
        return 2
    if a.command in ("tasks", "webhooks"):
        from gateway.tasks_worker import run_tasks

        return run_tasks(settings, burst=a.burst, webhooks=a.command == "webhooks")
    return serve(settings)


def serve(settings: GatewaySettings) -> int:
    import uvicorn

    from gateway.app import create_app
    from gateway.server import protocol_with_header_deadline
    from protocol.logs import configure_logging

    configure_logging(settings.log_level, settings.log_json, libraries="info")
    try:
        app = create_app(settings)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    # Our own structlog lines carry the request outcomes; uvicorn's access log would repeat each one.
    # Slow clients: headers within header_timeout_s (server.py), bodies at min_body_rate (limits.py), idle
    # keep-alive connections closed after 5 s, and at most 64 KiB of headers.
    uvicorn.run(app, host=settings.host, port=settings.port, log_config=None, access_log=False,
                proxy_headers=True, timeout_graceful_shutdown=30, timeout_keep_alive=5,
                http=protocol_with_header_deadline(settings.header_timeout_s),
                h11_max_incomplete_event_size=64 * 1024)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
