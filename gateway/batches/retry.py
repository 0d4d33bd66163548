"""POST /v1/batches/{id}/retry (tokenbus extension): a new batch of an ended batch's failed, cancelled and
expired lines, copied from its input file (producer/batch_retry.py picks them), as a new input file of the
same key; the new batch has the old one's endpoint, window, metadata and webhook, and the two name each other
(`retry_of`, `retried_by`)."""

from __future__ import annotations

from typing import Any

from gateway.batches import service
from gateway.batches.records import GatewayBatch
from gateway.context import GatewayContext
from gateway.errors import APIError
from producer.batch_retry import pick_lines, unfinished_lines
from protocol.errors import TokenbusError

CHUNK_LINES = 1000


def _conflict(message: str) -> APIError:
    return APIError(409, message, param="batch_id", code="batch_not_retryable")


def retry_batch(ctx: GatewayContext, owner: str, batch_id: str) -> dict[str, Any]:
    gw: GatewayBatch = service.owned(ctx, owner, batch_id)
    if gw.final_status is None:
        raise _conflict(f"batch {batch_id} has not ended yet; retry it once it is completed, failed, expired or "
                        "cancelled")
    if gw.retried_by:
        raise _conflict(f"batch {batch_id} was retried already by {gw.retried_by}; retry that one instead")
    if gw.errors:  # its file had invalid lines: nothing of it ran, and the same lines would fail again
        raise _conflict(f"batch {batch_id} failed validating its input file; fix the lines its errors name "
                        "and upload the file again")
    try:
        wanted = unfinished_lines(ctx.client, batch_id)
    except TokenbusError as err:  # nothing unfinished, or its job records expired (result_ttl)
        raise _conflict(str(err)) from None
    source = ctx.files.get(owner, gw.input_file_id)
    upload = ctx.files.open_upload(owner)
    try:
        with ctx.files.path(source.id).open("rb") as f:
            chunk: list[bytes] = []
            for line in pick_lines(f, wanted):
                chunk.append(line)
                if len(chunk) >= CHUNK_LINES:
                    upload.write(b"".join(chunk))
                    chunk = []
            upload.write(b"".join(chunk))
        meta = upload.commit(f"{batch_id}_retry.jsonl", "batch")
    except BaseException:
        upload.abort()
        raise
    req = service.CreateBatch(input_file_id=meta.id, endpoint=gw.endpoint, completion_window=gw.completion_window,
                              metadata=gw.metadata, webhook_url=gw.webhook_url,
                              output_expires_after=None if gw.output_expires_s is None else
                              service.ExpiresAfter(anchor="created_at", seconds=gw.output_expires_s))
    return service.create(ctx, owner, req, retry_of=batch_id)
