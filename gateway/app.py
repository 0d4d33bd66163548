"""create_app: the gateway's FastAPI application: the routes of api/, the dashboard (ui/), the body limits."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio.to_thread
import structlog
from fastapi import FastAPI

from gateway import errors
from gateway.api import ROUTERS
from gateway.api.service import Health
from gateway.batches import capacity
from gateway.context import GatewayContext
from gateway.limits import BodyLimit
from gateway.settings import GatewaySettings
from gateway.throttle import check_key_strength
from gateway.webhooks.delivery import parse_networks
from gateway.webhooks.secrets import check_master

log = structlog.get_logger("tokenbus.gateway")


def create_app(settings: GatewaySettings | None = None) -> FastAPI:
    settings = settings or GatewaySettings()
    if not settings.keys_by_owner:
        raise ValueError("no API keys: set TOKENBUS_GATEWAY_API_KEYS to one or more comma-separated keys "
                         "(e.g. `openssl rand -hex 24`); the gateway serves no anonymous requests")
    check_key_strength(list(settings.keys_by_owner.values()))
    for name, value in (("TOKENBUS_GATEWAY_WEBHOOK_SECRET", settings.webhook_secret),
                        ("TOKENBUS_GATEWAY_WEBHOOK_PREVIOUS_SECRET", settings.webhook_previous_secret)):
        if value:
            check_master(name, value)
    parse_networks(settings.webhook_allow_networks)  # ValueError naming a bad CIDR
    ctx = GatewayContext(settings)
    capacity.check_at_start(ctx)  # ValueError: a maxmemory below redis_reserve_bytes refuses every batch

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        # Short blocking calls (Redis reads, file writes) run in threads; streams wait in none (live/streams.py).
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
        await app.state.health.aclose()

    # openapi_url=None: the schema is served by api/service.py, behind the API key like every other route.
    app = FastAPI(title="tokenbus-gateway", version="1", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.ctx = ctx
    errors.install(app)
    app.state.health = Health(settings.redis_url)
    for router in ROUTERS:
        app.include_router(router)
    if settings.ui_enabled:
        from gateway import ui  # jinja2 loads only with the dashboard

        ui.mount(app)

    app.add_middleware(BodyLimit, max_body=settings.max_body_bytes, max_upload=settings.max_upload_bytes,
                       grace_s=settings.body_grace_s, min_rate=settings.min_body_rate)
    return app
