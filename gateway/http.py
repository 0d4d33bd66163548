"""Small request helpers the routers share."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request

from gateway.context import GatewayContext
from gateway.errors import invalid


def get_ctx(request: Request) -> GatewayContext:
    return request.app.state.ctx


async def json_body(request: Request) -> dict[str, Any]:
    """The JSON object body (read under the BodyLimit middleware's cap), or a 400 saying what is wrong."""
    raw = await request.body()
    try:
        body = json.loads(raw) if raw else None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise invalid(f"the request body is not valid JSON ({err}); send a JSON object with "
                      "Content-Type: application/json") from None
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    return body
