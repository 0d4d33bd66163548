"""GET /v1/models and /v1/models/{model}: the namespace's model registry in OpenAI's shape, plus what tokenbus
knows of each model (its live workers, kind, aliases, context length, jobs in its queues). A LoRA adapter is listed
as a model of its own with its base as `parent`, as vLLM lists them."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool

from gateway.auth import owner
from gateway.context import GatewayContext
from gateway.errors import model_not_found
from gateway.http import get_ctx
from producer import models
from protocol.errors import ModelNotFound
from protocol.records import ModelInfo

router = APIRouter()


def model_object(info: ModelInfo, created: float | None) -> dict[str, Any]:
    """OpenAI's model object ({id, object, created, owned_by}), vLLM's `root` (where its weights come from) and
    `parent` (a LoRA adapter's base model; null for a base), and tokenbus's fields beside them."""
    return {"id": info.id, "object": "model", "created": int(created or 0), "owned_by": "tokenbus",
            "root": info.root or info.id, "parent": info.parent,
            "workers": info.workers, "kind": info.kind, "kinds": info.kinds,
            "aliases": [n for n in info.names if n != info.id],
            "context_length": info.context_length, "default": info.default, "queued": info.queue_depth,
            "unserved": info.unserved}


def _listing(ctx: GatewayContext) -> list[dict[str, Any]]:
    r, k = ctx.client.redis, ctx.client.keys
    records = models.declared(r, k)
    infos = models.model_infos(r, k, models.live_heartbeats(r, k))
    return [model_object(i, records[i.id].declared_at) for i in infos if i.id in records]


@router.get("/v1/models")
async def list_models(request: Request, _who: str = Depends(owner)) -> dict[str, Any]:
    return {"object": "list", "data": await run_in_threadpool(_listing, get_ctx(request))}


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, request: Request, _who: str = Depends(owner)) -> dict[str, Any]:
    """Any of a model's names finds it (its id, an alias, a worker's --model value)."""
    ctx = get_ctx(request)

    def find() -> dict[str, Any]:
        r, k = ctx.client.redis, ctx.client.keys
        try:
            record = models.lookup(r, k, model)
        except ModelNotFound as err:
            raise model_not_found(err) from None
        return next(o for o in _listing(ctx) if o["id"] == record.id)

    return await run_in_threadpool(find)
