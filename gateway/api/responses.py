"""POST /v1/responses: OpenAI's Responses API, one job like a chat completion (api/completions.py), its body
mapped by producer/openai_responses.py, streamed with the Responses event types (live/responses_sse.py)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request

from gateway.api.completions import complete
from gateway.auth import owner
from producer.openai_responses import RESPONSES

router = APIRouter()


@router.post("/v1/responses")
async def responses(request: Request, who: str = Depends(owner)) -> Any:
    return await complete(request, who, RESPONSES)
