"""create_app: the gateway's FastAPI application (OpenAI-shaped files, batches, completions; tokenbus jobs)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio.to_thread
import structlog
from fastapi import Depends, FastAPI, Request

from gateway import completions, errors, jobs, models_api, routes
from gateway.auth import owner
from gateway.context import GatewayContext
from gateway.errors import APIError
from gateway.limits import BodyLimit
from gateway.secrets import check_master, key_secret
from gateway.settings import GatewaySettings
from gateway.webhooks import parse_networks
from protocol.connection import async_redis_from_url

log = structlog.get_logger("tokenbus.gateway")


def create_app(settings: GatewaySettings | None = None) -> FastAPI:
    settings = settings or GatewaySettings()
    if not settings.keys_by_owner:
        raise ValueError("no API keys: set TOKENBUS_GATEWAY_API_KEYS to one or more comma-separated keys "
                         "(e.g. `openssl rand -hex 24`); the gateway serves no anonymous requests")
    for name, value in (("TOKENBUS_GATEWAY_WEBHOOK_SECRET", settings.webhook_secret),
                        ("TOKENBUS_GATEWAY_WEBHOOK_PREVIOUS_SECRET", settings.webhook_previous_secret)):
        if value:
            check_master(name, value)
    parse_networks(settings.webhook_allow_networks)  # ValueError naming a bad CIDR
    ctx = GatewayContext(settings)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        # Short blocking calls (Redis reads, file writes) run in threads; streams wait in none (streams.py).
        anyio.to_thread.current_default_thread_limiter().total_tokens = settings.stream_threads
        ctx.files.root.mkdir(parents=True, exist_ok=True)
        ctx.waiter.start()
        ctx.streams.start()
        ctx.cancels.start()
        log.info("gateway_started", namespace=settings.namespace, keys=len(ctx.api_keys),
                 files_dir=str(settings.files_dir), webhooks=bool(settings.webhook_secret))
        yield
        ctx.waiter.stop()
        ctx.close()
        await health.aclose()

    # openapi_url=None: the schema is served below, behind the API key like every other route.
    app = FastAPI(title="tokenbus-gateway", version="1", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.ctx = ctx
    errors.install(app)
    app.include_router(routes.router)
    app.include_router(completions.router)
    app.include_router(jobs.router)
    app.include_router(models_api.router)
    if settings.ui_enabled:
        from gateway import ui  # jinja2 loads only with the dashboard

        ui.mount(app)

    # /healthz pings on its own connection, on the event loop: no pool, no thread, so a flood of other
    # requests cannot make it fail (compose's healthcheck allows 4 s).
    health = async_redis_from_url(settings.redis_url, socket_timeout=2, socket_connect_timeout=2)
    health_lock = asyncio.Lock()

    @app.get("/healthz", include_in_schema=False)
    async def healthz(request: Request) -> dict[str, Any]:
        """No key needed: 200 while Redis answers (compose's healthcheck), 503 otherwise."""
        try:
            async with health_lock:
                await asyncio.wait_for(health.ping(), 3.0)
        except Exception as err:
            log.warning("healthz_redis_error", error=str(err))  # the log has why; the public answer does not
            raise APIError(503, "Redis does not answer", code="redis_unavailable") from None
        return {"status": "ok"}

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(_who: str = Depends(owner)) -> dict[str, Any]:
        return app.openapi()

    @app.get("/v1/webhook_secret", include_in_schema=True)
    async def webhook_secret(who: str = Depends(owner)) -> dict[str, Any]:
        """This API key's own signing secret (tokenbus extension): verify our webhooks with it."""
        if not settings.webhook_secret:
            raise APIError(404, "this gateway sends no webhooks (TOKENBUS_GATEWAY_WEBHOOK_SECRET is unset)",
                           code="webhooks_disabled")
        previous = key_secret(settings.webhook_previous_secret, who) if settings.webhook_previous_secret else None
        return {"object": "webhook_secret", "secret": key_secret(settings.webhook_secret, who),
                "previous_secret": previous}

    app.add_middleware(BodyLimit, max_body=settings.max_body_bytes, max_upload=settings.max_upload_bytes,
                       grace_s=settings.body_grace_s, min_rate=settings.min_body_rate)
    return app
