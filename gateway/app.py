"""create_app: the gateway's FastAPI application (OpenAI-shaped files, batches, completions; tokenbus jobs)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio.to_thread
import structlog
from fastapi import FastAPI, Request
from starlette.concurrency import run_in_threadpool

from gateway import completions, errors, jobs, routes
from gateway.context import GatewayContext
from gateway.errors import APIError
from gateway.limits import BodyLimit
from gateway.settings import GatewaySettings

log = structlog.get_logger("tokenbus.gateway")


def create_app(settings: GatewaySettings | None = None) -> FastAPI:
    settings = settings or GatewaySettings()
    if not settings.keys_by_owner:
        raise ValueError("no API keys: set TOKENBUS_GATEWAY_API_KEYS to one or more comma-separated keys "
                         "(e.g. `openssl rand -hex 24`); the gateway serves no anonymous requests")
    if settings.webhook_secret:
        from standardwebhooks import Webhook

        try:
            Webhook(settings.webhook_secret)
        except Exception as err:
            raise ValueError(f"TOKENBUS_GATEWAY_WEBHOOK_SECRET is not a usable secret ({err}); use whsec_ and "
                             "base64, e.g. whsec_$(openssl rand -base64 32)") from None
    ctx = GatewayContext(settings)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        # Streams wait in threads (Client.stream blocks): allow as many as configured, not AnyIO's 40.
        anyio.to_thread.current_default_thread_limiter().total_tokens = settings.stream_threads
        ctx.files.root.mkdir(parents=True, exist_ok=True)
        ctx.waiter.start()
        log.info("gateway_started", namespace=settings.namespace, keys=len(ctx.api_keys),
                 files_dir=str(settings.files_dir), webhooks=bool(settings.webhook_secret))
        yield
        ctx.waiter.stop()
        ctx.close()

    app = FastAPI(title="tokenbus-gateway", version="1", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.ctx = ctx
    errors.install(app)
    app.include_router(routes.router)
    app.include_router(completions.router)
    app.include_router(jobs.router)

    @app.get("/healthz", include_in_schema=False)
    async def healthz(request: Request) -> dict[str, Any]:
        """No key needed: 200 while Redis answers (compose's healthcheck), 503 otherwise."""
        try:
            await run_in_threadpool(ctx.redis.ping)
        except Exception as err:
            raise APIError(503, f"Redis does not answer: {err}", code="redis_unavailable") from None
        return {"status": "ok"}

    app.add_middleware(BodyLimit, max_body=settings.max_body_bytes, max_upload=settings.max_upload_bytes)
    return app
