"""Small request helpers the routers share."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request

from gateway.context import GatewayContext
from gateway.errors import invalid
from protocol.text import surrogate_problem


def get_ctx(request: Request) -> GatewayContext:
    return request.app.state.ctx


async def json_body(request: Request) -> dict[str, Any]:
    """The JSON object body (read under the BodyLimit middleware's cap), or a 400 saying what is wrong (also
    a string that is not storable UTF-8, naming its field)."""
    raw = await request.body()
    try:
        body = json.loads(raw) if raw else None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise invalid(f"the request body is not valid JSON ({err}); send a JSON object with "
                      "Content-Type: application/json") from None
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    if bad := surrogate_problem(raw, body):  # refused here: stored, it broke the key's listings for good
        raise invalid(bad[1], param=bad[0], code="invalid_text")
    return body
