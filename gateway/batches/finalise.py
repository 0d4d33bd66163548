"""The finalise task's work: an ended batch's output file (its 200 lines) and error file (the rest), made from
`tokenbus batch export` lines in OpenAI's shapes (error_lines.py); then its reservation back, what its job
records keep counted in the key's ledger until they expire (capacity.release), and its webhook. The files go
after output_expires_after, else with the batch's record (batch_retention_s, retention.py)."""

from __future__ import annotations

import hashlib
import json
import time

import structlog

from gateway.batches import capacity, error_lines, retention
from gateway.batches.records import GatewayBatch, load_core
from gateway.context import GatewayContext
from gateway.enqueue import enqueue_webhook
from gateway.files.store import FileMeta
from producer import batches
from protocol.models import BatchStatus

log = structlog.get_logger("tokenbus.gateway")


def _file_id(batch_id: str, kind: str) -> str:
    # Deterministic, so a retried finalisation rewrites the same files instead of adding new ones.
    return "file-" + hashlib.sha256(f"{batch_id}:{kind}".encode()).hexdigest()[:24]


def _records_bytes(ctx: GatewayContext, batch_id: str) -> int:
    """What the batch's job records hold in Redis now, and keep for result_ttl: Redis's own count (MEMORY USAGE,
    every field), a pipeline a chunk of ids. Their export lines are no measure: OpenAI's logprobs shape repeats
    each candidate's text and bytes, twice what a record holds."""
    held = 0
    for chunk in batches.iter_batch_job_ids(ctx.client, batch_id):
        pipe = ctx.redis.pipeline(transaction=False)
        for job_id in chunk:
            pipe.memory_usage(ctx.keys.job(job_id), samples=0)
        held += sum(int(b or 0) for b in pipe.execute())
    return held


def finalize(ctx: GatewayContext, batch_id: str) -> str:
    """Ended batch -> output file (successful lines) + error file (the rest), from `tokenbus batch export`."""
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
            expires_at = retention.files_expire_at(ctx, now, gw.output_expires_s)  # else with the record
            ctx.files.register(FileMeta(id=fid, owner=gw.owner, filename=f"{batch_id}_{kind}.jsonl",
                                        purpose="batch_output", bytes=paths[kind].stat().st_size, created_at=now,
                                        expires_at=expires_at))
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
    gw.input_tokens, gw.cached_tokens, gw.output_tokens = core.input_tokens, core.cached_tokens, core.output_tokens
    gw.finalizing_at = gw.finalizing_at or now
    pipe = ctx.redis.pipeline(transaction=True)
    pipe.hset(ctx.gkeys.batch(batch_id), mapping=gw.fields(
        "final_status", "ended_at", "output_file_id", "error_file_id", "total", "completed", "failed",
        "in_progress_at", "input_tokens", "cached_tokens", "output_tokens"))
    pipe.srem(ctx.gkeys.open_batches, batch_id)
    pipe.execute()
    capacity.release(ctx, batch_id, gw.owner, _records_bytes(ctx, batch_id))
    log.info("gateway_batch_finalized", batch_id=batch_id, status=gw.final_status, output_lines=lines["output"],
             error_lines=lines["error"])
    enqueue_webhook(ctx, gw)
    return gw.final_status
