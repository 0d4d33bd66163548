"""Batches as OpenAI's /v1/batches sees them: create, retrieve, list (cursor pages), cancel.

The jobs themselves are written by the submit task (tasks.py) with producer.batches.submit_batch, so a
batch made here is the same batch `tokenbus batch submit` makes from the same file.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from gateway.batches import capacity, ingest
from gateway.batches.records import WINDOWS, GatewayBatch, batch_object, load_core
from gateway.context import GatewayContext
from gateway.enqueue import enqueue_submit
from gateway.errors import APIError, invalid, not_found
from gateway.webhooks.delivery import check_url, literal_address_problem
from producer import batches, models
from producer.openai_batch import KNOWN, SERVED
from protocol.models import describe_validation_error

MAX_METADATA = 16  # OpenAI's limits on metadata
MAX_PAGE = 100
MAX_OUTPUT_EXPIRES_S = 30 * 24 * 3600  # OpenAI's longest output_expires_after


class ExpiresAfter(BaseModel):
    """output_expires_after: the output and error files are deleted this long after they are made."""

    model_config = ConfigDict(extra="forbid", strict=True)

    anchor: Literal["created_at"]
    seconds: int


class CreateBatch(BaseModel):
    """POST /v1/batches. webhook_url is the tokenbus extension (OpenAI SDK: extra_body={"webhook_url": ...})."""

    model_config = ConfigDict(extra="forbid", strict=True)

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    output_expires_after: ExpiresAfter | None = None
    webhook_url: str | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v is not None:
            if len(v) > MAX_METADATA:
                raise ValueError(f"at most {MAX_METADATA} key-value pairs")
            for k, val in v.items():
                if len(k) > 64 or len(val) > 512:
                    raise ValueError(f"keys up to 64 characters and values up to 512 (key {k[:70]!r})")
        return v


def parse_create(body: Any) -> CreateBatch:
    try:
        return CreateBatch.model_validate(body)
    except ValidationError as err:
        first = err.errors()[0]
        raise invalid(describe_validation_error(err), param=".".join(str(p) for p in first["loc"])) from None


def create(ctx: GatewayContext, owner: str, req: CreateBatch, retry_of: str | None = None) -> dict[str, Any]:
    if req.endpoint not in SERVED:
        known = "an endpoint of OpenAI's that" if req.endpoint in KNOWN else "not an endpoint that"
        raise invalid(f"endpoint {req.endpoint!r} is {known} this gateway serves; served: {', '.join(SERVED)}",
                      param="endpoint", code="unsupported_endpoint")
    expires_s = req.output_expires_after.seconds if req.output_expires_after else None
    if expires_s is not None and not ctx.settings.min_output_expires_s <= expires_s <= MAX_OUTPUT_EXPIRES_S:
        raise invalid(f"output_expires_after.seconds must be between {ctx.settings.min_output_expires_s} and "
                      f"{MAX_OUTPUT_EXPIRES_S} (30 days); got {expires_s}", param="output_expires_after.seconds")
    if req.completion_window not in WINDOWS:
        raise invalid(f"completion_window must be one of {', '.join(WINDOWS)} (got {req.completion_window!r})",
                      param="completion_window")
    if req.webhook_url is not None:
        if problem := check_url(req.webhook_url):
            raise invalid(problem, param="webhook_url")
        if problem := literal_address_problem(req.webhook_url, ctx.settings.webhook_allow_networks):
            raise invalid(problem, param="webhook_url", code="webhook_url_not_public")
        if not ctx.settings.webhook_secret:
            raise invalid("this gateway has no webhook signing secret, so it sends no webhooks; leave out "
                          "webhook_url or ask the operator to set TOKENBUS_GATEWAY_WEBHOOK_SECRET",
                          param="webhook_url", code="webhooks_disabled")
    meta = ctx.files.get(owner, req.input_file_id)
    if meta.purpose != "batch":
        raise invalid(f"file {meta.id} has purpose {meta.purpose!r}; a batch's input needs purpose 'batch'",
                      param="input_file_id")
    if meta.endpoint != req.endpoint and not (meta.line_errors and meta.endpoint is None):
        raise invalid(f"the lines of file {meta.id} use url {meta.endpoint}, but this batch's endpoint is "
                      f"{req.endpoint}; they must match", param="endpoint", code="mismatched_endpoint")
    if meta.models:  # 404 model_not_found, listing the declared ones, before anything is queued
        models.resolve(ctx.client.redis, ctx.client.keys, meta.models)
    now = time.time()
    gw = GatewayBatch(id=f"batch_{uuid.uuid4().hex}", owner=owner, input_file_id=meta.id, endpoint=req.endpoint,
                      completion_window=req.completion_window, created_at=now,
                      expires_at=now + WINDOWS[req.completion_window], metadata=req.metadata,
                      webhook_url=req.webhook_url, total=meta.requests, errors=meta.line_errors,
                      tokens=meta.tokens, model=next((m for m in meta.models or [] if m), None),
                      output_expires_s=expires_s, retry_of=retry_of)
    # A file with invalid lines queues nothing (it fails in validating, OpenAI's way): only its record counts.
    queued = 0 if gw.errors else capacity.estimate(meta.requests or 0, meta.bytes, meta.result_bytes or 0)
    # 429 naming the limit (the key's queued requests, tokens, bytes; everyone's bytes): nothing was written.
    # A retry's link back (the ended batch names the batch that re-runs its unfinished lines) is written with it.
    capacity.admit(ctx, gw, 0 if gw.errors else meta.requests or 0, 0 if gw.errors else meta.tokens or 0, queued)
    enqueue_submit(ctx, gw.id)
    return batch_object(gw, None)


def owned(ctx: GatewayContext, owner: str, batch_id: str) -> GatewayBatch:
    gw = GatewayBatch.load(ctx.redis, ctx.gkeys, batch_id) if batch_id.startswith("batch_") else None
    if gw is None or gw.owner != owner:
        raise not_found("batch", batch_id)
    return gw


def retrieve(ctx: GatewayContext, owner: str, batch_id: str) -> dict[str, Any]:
    gw = owned(ctx, owner, batch_id)
    return batch_object(gw, None if gw.final_status else load_core(ctx.redis, ctx.keys, batch_id))


def cancel(ctx: GatewayContext, owner: str, batch_id: str) -> dict[str, Any]:
    gw = owned(ctx, owner, batch_id)
    core = None if gw.final_status else load_core(ctx.redis, ctx.keys, batch_id)
    if gw.final_status or (core is not None and core.is_terminal and not gw.cancel_requested_at):
        status = gw.final_status or "finalizing"
        raise APIError(409, f"batch {batch_id} is {status}: it can no longer be cancelled", param="batch_id",
                       code="batch_not_cancellable")
    key = ctx.gkeys.batch(batch_id)
    ctx.redis.hsetnx(key, "cancel_requested_at", time.time())
    # Set before reading submitted_at, while the submit task sets submitted_at before reading this: one
    # of the two always sees the other and cancels the producer's batch (twice is harmless).
    if ctx.redis.hget(key, "submitted_at"):
        batches.cancel_batch(ctx.client, batch_id)
    else:  # ends `cancelled` now if nobody is submitting it; a submit holding the lease sees the cancel
        ingest.end_unsubmitted(ctx, batch_id, "cancel", "cancelled", [])
    return retrieve(ctx, owner, batch_id)


def list_page(ctx: GatewayContext, owner: str, after: str | None, limit: int) -> dict[str, Any]:
    """Newest first, as OpenAI lists them; `after` is the last id of the previous page. An entry whose record
    has gone (past batch_retention_s, before the watcher removed the entry) is skipped, the page filled on."""
    if not 1 <= limit <= MAX_PAGE:
        raise invalid(f"limit must be between 1 and {MAX_PAGE} (got {limit})", param="limit")
    key = ctx.gkeys.batches(owner)
    start = 0
    if after:
        rank = ctx.redis.zrevrank(key, after)
        if rank is None:
            raise invalid(f"after: no batch {after!r} in your list (or it ended more than batch_retention_s ago "
                          "and was deleted); pass the last_id of the previous page", param="after")
        start = rank + 1
    data: list[dict[str, Any]] = []
    has_more = False
    while not has_more:
        need = limit - len(data)
        ids = ctx.redis.zrevrange(key, start, start + need)  # one more than needed: is there another page?
        start += len(ids)
        for bid in ids:
            if gw := GatewayBatch.load(ctx.redis, ctx.gkeys, bid):
                if len(data) == limit:
                    has_more = True
                    break
                data.append(batch_object(gw, None if gw.final_status else load_core(ctx.redis, ctx.keys, bid)))
        if len(ids) <= need:  # the list has no more
            break
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}
