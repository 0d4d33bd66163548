"""/v1/webhook_secret (tokenbus extension): this API key's own webhook signing secret (webhooks/secrets.py)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request

from gateway.auth import owner
from gateway.errors import APIError
from gateway.http import get_ctx
from gateway.webhooks.secrets import key_secret

router = APIRouter()


@router.get("/v1/webhook_secret")
async def webhook_secret(request: Request, who: str = Depends(owner)) -> dict[str, Any]:
    """This API key's own signing secret (tokenbus extension): verify our webhooks with it."""
    settings = get_ctx(request).settings
    if not settings.webhook_secret:
        raise APIError(404, "this gateway sends no webhooks (TOKENBUS_GATEWAY_WEBHOOK_SECRET is unset)",
                       code="webhooks_disabled")
    previous = key_secret(settings.webhook_previous_secret, who) if settings.webhook_previous_secret else None
    return {"object": "webhook_secret", "secret": key_secret(settings.webhook_secret, who),
            "previous_secret": previous}
