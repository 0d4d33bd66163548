"""RQ jobs of the gateway: submit a batch's file, finalise an ended batch, deliver its webhook.

They run in `tokenbus-gateway tasks` (tasks_worker.py), on the RQ queue `{namespace}-gateway` in the same
Redis; webhook deliveries on their own queue `{namespace}-gateway-webhooks`, worked by `tokenbus-gateway
webhooks`, so a slow receiver never delays a submit or a finalisation. Each is idempotent and keyed by
the batch id (RQ job ids `submit-`, `finalize-`, `webhook-{batch}`), so a retry or a second enqueue never
duplicates jobs, files or deliveries. Failures retry with RQ's Retry and backoff; what still fails lands
in RQ's failed-job registry (`rq info`, `rq requeue`).
"""

from __future__ import annotations

import hashlib
import json
import time

import redis
import structlog

from gateway import capacity, error_lines, ingest
from gateway.batch_records import GatewayBatch, batch_object, load_core
from gateway.context import GatewayContext
from gateway.enqueue import enqueue_finalize, enqueue_submit, enqueue_webhook  # noqa: F401 (callers use tasks.*)
from gateway.files import FileMeta
from gateway.secrets import signing_secrets
from gateway.settings import GatewaySettings
from gateway.webhooks import deliver, parse_networks
from producer import batches
from protocol.errors import InvalidBatch, ModelNotFound, QueueFull
from protocol.models import BatchStatus

log = structlog.get_logger("tokenbus.gateway")

_CTX: GatewayContext | None = None


def context() -> GatewayContext:
    """The tasks process's context, built once from the environment (RQ passes only the batch id)."""
    global _CTX
    if _CTX is None:
        _CTX = GatewayContext(GatewaySettings())
    return _CTX


def set_context(ctx: GatewayContext | None) -> None:
    global _CTX
    _CTX = ctx


# ---- the jobs ------------------------------------------------------------------------------------------------

def submit_batch(batch_id: str) -> str:
    """Write the batch's jobs from its input file with producer.batches.submit_batch (the CLI's machinery).

    Holds the batch's submit lease throughout (ingest.py). QueueFull or Redis out of memory fail the batch
    at once, its written jobs removed; other errors (a lost connection) raise, so RQ retries; when RQ gives
    up, the watcher's sweep fails the batch."""
    ctx = context()
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
    if gw.errors:  # the input file's lines were invalid (files.py): OpenAI fails such a batch in validating
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
        # One pass, no spool: the upload validated every line (files.py), so each is sent as it is read again
        meta = ctx.files.find(gw.owner, gw.input_file_id)
        checked = (gw.endpoint, gw.total, (meta.models if meta else None) or []) if gw.total else None
        batches.submit_batch(ctx.client, path, batch_id=batch_id, validated=checked, spool_dir=ctx.files.root)
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


def _file_id(batch_id: str, kind: str) -> str:
    # Deterministic, so a retried finalisation rewrites the same files instead of adding new ones.
    return "file-" + hashlib.sha256(f"{batch_id}:{kind}".encode()).hexdigest()[:24]


def finalize_batch(batch_id: str) -> str:
    """Ended batch -> output file (successful lines) + error file (the rest), from `tokenbus batch export`."""
    ctx = context()
    gw = GatewayBatch.load(ctx.redis, ctx.gkeys, batch_id)
    if gw is None or gw.final_status:
        return "nothing to do"
    core = load_core(ctx.redis, ctx.keys, batch_id)
    if core is None or not core.is_terminal:
        raise RuntimeError(f"batch {batch_id} has not ended ({core.status if core else 'no record'}); "
                           "finalisation runs only after every job has ended")
    now = time.time()
    ctx.redis.hsetnx(ctx.gkeys.batch(batch_id), "finalizing_at", now)
    export = ctx.files.root / f".{batch_id}.export"
    batches.export_batch(ctx.client, batch_id, export)  # streams records in chunks to the file
    ids = {"output": _file_id(batch_id, "output"), "error": _file_id(batch_id, "error")}
    lines = {"output": 0, "error": 0}
    paths = {kind: ctx.files.path(fid) for kind, fid in ids.items()}
    for p in paths.values():
        p.parent.mkdir(parents=True, exist_ok=True)
    with export.open("rb") as src, paths["output"].open("wb") as out, paths["error"].open("wb") as err:
        for raw in src:
            # OpenAI's split and shapes: a 200 response to the output file, everything else to the errors.
            kind, line = error_lines.openai_line(json.loads(raw), expired=gw.expire_requested_at is not None)
            (out if kind == "output" else err).write(line)
            lines[kind] += 1
    export.unlink(missing_ok=True)
    for kind, fid in ids.items():
        if lines[kind]:
            ctx.files.register(FileMeta(id=fid, owner=gw.owner, filename=f"{batch_id}_{kind}.jsonl",
                                        purpose="batch_output", bytes=paths[kind].stat().st_size, created_at=now))
        else:
            paths[kind].unlink(missing_ok=True)
    ended_by_expiry = gw.expire_requested_at is not None
    gw.final_status = "expired" if ended_by_expiry else \
        "cancelled" if core.status == BatchStatus.cancelled else "completed"
    gw.ended_at = time.time()
    gw.output_file_id = ids["output"] if lines["output"] else None
    gw.error_file_id = ids["error"] if lines["error"] else None
    gw.total, gw.completed, gw.failed = core.total, core.finished, core.failed + core.cancelled
    gw.in_progress_at = core.in_progress_at
    gw.finalizing_at = gw.finalizing_at or now
    pipe = ctx.redis.pipeline(transaction=True)
    pipe.hset(ctx.gkeys.batch(batch_id), mapping=gw.fields(
        "final_status", "ended_at", "output_file_id", "error_file_id", "total", "completed", "failed",
        "in_progress_at"))
    pipe.srem(ctx.gkeys.open_batches, batch_id)
    pipe.execute()
    capacity.release(ctx, batch_id, gw.owner)
    log.info("gateway_batch_finalized", batch_id=batch_id, status=gw.final_status, output_lines=lines["output"],
             error_lines=lines["error"])
    enqueue_webhook(ctx, gw)
    return gw.final_status


def event_id(batch_id: str) -> str:
    """The webhook-id of a batch's end event: the same on every attempt, so receivers can dedupe."""
    return "msg_" + hashlib.sha256(f"{batch_id}:ended".encode()).hexdigest()[:24]


def deliver_batch_webhook(batch_id: str) -> int:
    """One attempt at the batch's webhook; raising makes RQ retry it after the next backoff interval."""
    ctx = context()
    gw = GatewayBatch.load(ctx.redis, ctx.gkeys, batch_id)
    raw = ctx.redis.hmget(ctx.gkeys.batch(batch_id), "webhook_delivered_at")
    if gw is None or not gw.webhook_url or raw[0]:
        return 0
    data = batch_object(gw, None)
    event = {"id": event_id(batch_id), "object": "event", "type": f"batch.{gw.final_status}",
             "created_at": int(gw.ended_at or time.time()), "data": data}
    key = ctx.gkeys.batch(batch_id)
    attempt = ctx.redis.hincrby(key, "webhook_attempts", 1)
    try:
        s = ctx.settings
        status = deliver(gw.webhook_url, signing_secrets(s.webhook_secret, s.webhook_previous_secret, gw.owner),
                         event["id"], json.dumps(event), timeout_s=s.webhook_timeout_s,
                         allowed=parse_networks(s.webhook_allow_networks))
    except Exception as err:
        ctx.redis.hset(key, "webhook_last_error", str(err)[:500])
        log.warning("webhook_attempt_failed", batch_id=batch_id, attempt=attempt, error=str(err)[:200])
        raise
    ctx.redis.hset(key, mapping={"webhook_delivered_at": time.time(), "webhook_last_error": ""})
    log.info("webhook_delivered", batch_id=batch_id, attempt=attempt, status=status)
    return status
