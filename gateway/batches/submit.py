"""The submit task's work: a validating batch's jobs written from the requests its upload validated
(producer.batches.submit_batch, the CLI's machinery), under the batch's submit lease (ingest.py); what goes
wrong ends the batch `failed`."""

from __future__ import annotations

import time
from pathlib import Path

import redis
import structlog

from gateway.batches import ingest
from gateway.batches.records import GatewayBatch, load_core
from gateway.context import GatewayContext
from gateway.files.store import BATCH_PRIORITY
from producer import batches
from producer.batch_spool import Spooled, open_spool
from protocol.errors import InvalidBatch, ModelNotFound, QueueFull

log = structlog.get_logger("tokenbus.gateway")


def submit(ctx: GatewayContext, batch_id: str) -> str:
    """Write the batch's jobs from its input file with producer.batches.submit_batch (the CLI's machinery).

    Holds the batch's submit lease throughout (ingest.py). QueueFull or Redis out of memory fail the batch
    at once, its written jobs removed; other errors (a lost connection) raise, so RQ retries; when RQ gives
    up, the watcher's sweep fails the batch."""
    gw = GatewayBatch.load(ctx.redis, ctx.gkeys, batch_id)
    if gw is None or gw.final_status:
        return "nothing to do"
    lease = ingest.SubmitLease(ctx, batch_id, "submit")
    if not lease.acquire():
        return "a cancel, an expiry or another submit holds this batch"
    try:
        return _submit(ctx, batch_id)
    finally:
        lease.release()


def _submit(ctx: GatewayContext, batch_id: str) -> str:
    gw = GatewayBatch.load(ctx.redis, ctx.gkeys, batch_id)
    if gw is None or gw.final_status:  # ended by a cancel or the sweep before we took the lease
        return "nothing to do"
    if gw.cancel_requested_at and load_core(ctx.redis, ctx.keys, batch_id) is None:
        ingest.end_without_jobs(ctx, gw, "cancelled", [])
        return "cancelled before submission"
    if time.time() > gw.expires_at and load_core(ctx.redis, ctx.keys, batch_id) is None:
        ingest.end_without_jobs(ctx, gw, "expired", [])
        return "expired before submission"
    if gw.errors:  # the input file's lines were invalid (files/store.py): OpenAI fails such a batch in validating
        ingest.end_without_jobs(ctx, gw, "failed", gw.errors)
        return "invalid"
    path = ctx.files.path(gw.input_file_id)
    if not path.is_file():
        ingest.end_without_jobs(ctx, gw, "failed", [{"code": "file_not_found", "param": "input_file_id",
                                                     "line": None,
                                                     "message": f"input file {gw.input_file_id} was deleted"}])
        return "input file gone"
    # Open before the jobs exist: a batch that ends at once is still seen by the watcher.
    ctx.redis.sadd(ctx.gkeys.open_batches, batch_id)
    try:
        batches.submit_batch(ctx.client, _requests(ctx, gw, path), batch_id=batch_id, priority=BATCH_PRIORITY,
                             spool_dir=ctx.files.root)
    except ModelNotFound as err:  # retired since the batch was created
        if load_core(ctx.redis, ctx.keys, batch_id) is not None:
            ingest.fail_ingest(ctx, gw, "model_not_found", str(err))
        else:
            ingest.end_without_jobs(ctx, gw, "failed", [{"code": "model_not_found", "message": str(err),
                                                         "param": "model", "line": None}])
        return "model not found"
    except InvalidBatch as err:  # the upload validated it, so only a changed file gets here
        if load_core(ctx.redis, ctx.keys, batch_id) is not None:  # found part-way: remove what was written
            ingest.fail_ingest(ctx, gw, "invalid_file", f"the input file changed since its upload: {err}")
            return "invalid"
        errors = [{"code": "invalid_request", "message": msg, "param": None, "line": n}
                  for n, msg in err.line_errors] or [{"code": "invalid_file", "message": str(err),
                                                      "param": None, "line": None}]
        ingest.end_without_jobs(ctx, gw, "failed", errors)  # raised before any job was written
        return "invalid"
    except QueueFull as err:
        ingest.fail_ingest(ctx, gw, "queue_full", f"the job queue is full ({err}); create the batch again later")
        return "queue full"
    except redis.exceptions.OutOfMemoryError as err:
        ingest.fail_ingest(ctx, gw, "redis_out_of_memory",
                           f"Redis ran out of memory while this batch was queued ({err}); its jobs were removed. "
                           "Create it again when running batches have ended, or split the file")
        return "redis out of memory"
    pipe = ctx.redis.pipeline(transaction=True)
    pipe.hset(ctx.gkeys.batch(batch_id), "submitted_at", time.time())
    pipe.srem(ctx.gkeys.validating, batch_id)
    pipe.execute()
    # A cancel that came during the submit saw no submitted_at, so it left the cancelling to us.
    if ctx.redis.hget(ctx.gkeys.batch(batch_id), "cancel_requested_at"):
        batches.cancel_batch(ctx.client, batch_id)
    log.info("gateway_batch_submitted", batch_id=batch_id, owner=gw.owner)
    return "submitted"


def _requests(ctx: GatewayContext, gw: GatewayBatch, path: Path) -> Spooled | Path:
    """What the submit sends: the requests the upload validated, kept beside the file (files/store.py), as they
    are, with nothing parsed or validated again, in the prefix order the upload kept with them
    (producer/prefix_order.py, as the CLI sends; the output file stays in input order). A file uploaded before
    the gateway kept them is validated here, once, into a temporary spool (which orders it the same way)."""
    kept = ctx.files.requests_path(gw.input_file_id)
    if gw.total and kept.is_file():
        meta = ctx.files.find(gw.owner, gw.input_file_id)
        return open_spool(kept, gw.endpoint, gw.total, BATCH_PRIORITY, input_file=str(path),
                          models=meta.models if meta and meta.models is not None else None,
                          order_path=ctx.files.order_path(gw.input_file_id))
    return path
