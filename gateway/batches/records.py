"""The gateway's half of a batch, and the OpenAI batch object made from it and the producer's batch record.

Two records share one id: the producer's `{ns}:batch:{id}` (producer/batches.py: status and counts, kept
by the Lua that ends each job) and the gateway's `{ns}:gw:batch:{id}` (owner, input file, window, metadata,
webhook, and the end state once the output files exist). OpenAI's status comes from both:

  gateway: validating ──submit task──▶ producer: in_progress ──all jobs ended──▶ completed / cancelled
                                                                                 = OpenAI "finalizing"
           ──finalize task (output + error files)──▶ gateway: completed / cancelled / expired
"""

from __future__ import annotations

import json
from typing import Any

import redis
from pydantic import BaseModel, ConfigDict, field_validator

from gateway.keys import GatewayKeys, hash_fields
from protocol.errors import MAX_ERRORS_SHOWN
from protocol.keys import Keys
from protocol.models import BatchStatus
from protocol.records import BatchRecord
from protocol.text import bounded

FINAL = ("completed", "failed", "cancelled", "expired")
WINDOWS = {"24h": 24 * 3600}  # OpenAI accepts only 24h


class GatewayBatch(BaseModel):
    model_config = ConfigDict(validate_assignment=True)  # the errors' bound holds for `gw.errors = ...` too

    id: str
    owner: str
    input_file_id: str
    endpoint: str
    completion_window: str
    created_at: float
    expires_at: float
    metadata: dict[str, str] | None = None
    webhook_url: str | None = None
    final_status: str | None = None  # set once: failed (validation), or completed / cancelled / expired
    errors: list[dict[str, Any]] | None = None  # validation errors: {code, message, param, line}
    output_file_id: str | None = None
    error_file_id: str | None = None
    submitted_at: float | None = None  # the submit task wrote every job
    cancel_requested_at: float | None = None
    expire_requested_at: float | None = None
    finalizing_at: float | None = None
    ended_at: float | None = None  # completed_at / failed_at / cancelled_at / expired_at by final_status
    total: int | None = None  # the input file's requests; at finalisation, as the producer's record counted
    tokens: int | None = None  # the input file's token estimate (quota.py: queued tokens per key)
    # Copied from the producer's record at finalisation: that record expires after result_ttl.
    completed: int | None = None
    failed: int | None = None
    in_progress_at: float | None = None
    reserved_bytes: int | None = None  # estimated Redis bytes reserved at create (capacity.py)
    model: str | None = None  # the model the input file's requests name
    output_expires_s: int | None = None  # output_expires_after.seconds: its files go this long after they are made
    retry_of: str | None = None  # the ended batch whose failed lines this one re-runs (retry.py)
    retried_by: str | None = None  # the batch that re-runs this one's failed lines
    # Copied from the producer's record at finalisation, as the counts are: its finished jobs' tokens.
    input_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int | None = None

    @field_validator("errors")
    @classmethod
    def _bounded_errors(cls, v: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        """What a record holds of errors is bounded, whatever produced them (a 400 KB custom_id copied into
        each of 21 messages made one 109-byte POST store ~24 MB): MAX_ERRORS_SHOWN entries and a summary,
        each message bounded."""
        if not v:
            return v
        keep = MAX_ERRORS_SHOWN + 1  # the upload's own summary line after them fits
        out = [{**e, "message": bounded(str(e.get("message", "")))} for e in v[:keep]]
        if len(v) > keep:
            out.append({"code": "too_many_errors", "param": None, "line": None,
                        "message": f"... and {len(v) - keep} more errors"})
        return out

    @classmethod
    def load(cls, r: redis.Redis, gkeys: GatewayKeys, batch_id: str) -> GatewayBatch | None:
        return cls.from_hash(r.hgetall(gkeys.batch(batch_id)))

    @classmethod
    def from_hash(cls, raw: dict[str, str]) -> GatewayBatch | None:
        """The record from its Redis hash (as HGETALL gives it, also from a pipeline); None when it is empty, or
        holds no id: a late write (a webhook attempt's count) to a record deleted after its retention."""
        if not raw or "id" not in raw:
            return None
        return cls.model_validate(hash_fields(raw, ("metadata", "errors")))

    def fields(self, *names: str) -> dict[str, str | float | int]:
        """Hash fields for HSET: the named ones, None written as ''; with no names, every field that is set
        (unset ones stay absent, so the HSETNX guards on them still work)."""
        out: dict[str, Any] = {}
        for name in names or type(self).model_fields:
            value = getattr(self, name)
            if value is None and not names:
                continue
            out[name] = "" if value is None else json.dumps(value) if isinstance(value, dict | list) else value
        return out


def load_core(r: redis.Redis, keys: Keys, batch_id: str) -> BatchRecord | None:
    raw = r.hgetall(keys.batch(batch_id))
    return BatchRecord.from_record(raw) if raw else None


def openai_status(gw: GatewayBatch, core: BatchRecord | None) -> str:
    if gw.final_status:
        return gw.final_status
    if core is None or core.status == BatchStatus.validating:
        return "cancelling" if gw.cancel_requested_at else "validating"
    if core.status == BatchStatus.completed:
        return "finalizing"
    if gw.expire_requested_at:  # an expiry cancels the rest too, but OpenAI shows no "cancelling" for it
        return "finalizing" if core.is_terminal else "in_progress"
    if gw.cancel_requested_at or core.status in (BatchStatus.cancelling, BatchStatus.cancelled):
        return "cancelling"  # until the files of what finished exist; then "cancelled"
    return "in_progress"


def batch_object(gw: GatewayBatch, core: BatchRecord | None) -> dict[str, Any]:
    """OpenAI's batch object (usage: the finished requests' tokens, summed as they end), plus the tokenbus
    extension fields webhook_url, retry_of and retried_by."""
    status = openai_status(gw, core)
    if gw.final_status:
        counts = {"total": gw.total or 0, "completed": gw.completed or 0, "failed": gw.failed or 0}
    elif core is not None:
        # Cancelled requests are in the error file, so they count as failed: completed + failed = lines out.
        counts = {"total": core.total, "completed": core.finished, "failed": core.failed + core.cancelled}
    else:
        counts = {"total": gw.total or 0, "completed": 0, "failed": 0}
    in_progress_at = gw.in_progress_at or (core.in_progress_at if core else None)
    finalizing_at = gw.finalizing_at or (core.completed_at if core and core.is_terminal else None)
    cancelling_at = gw.cancel_requested_at or (core.cancelled_at if core and not gw.expire_requested_at else None)
    ended = {name: (gw.ended_at if gw.final_status == final else None)
             for name, final in (("completed_at", "completed"), ("failed_at", "failed"),
                                 ("expired_at", "expired"), ("cancelled_at", "cancelled"))}
    errors = {"object": "list", "data": gw.errors} if gw.errors else None
    tokens = (gw.input_tokens or 0, gw.cached_tokens or 0, gw.output_tokens or 0) if gw.final_status else \
        (core.input_tokens, core.cached_tokens, core.output_tokens) if core is not None else (0, 0, 0)
    usage = {"input_tokens": tokens[0], "input_tokens_details": {"cached_tokens": tokens[1]},
             "output_tokens": tokens[2], "output_tokens_details": {"reasoning_tokens": 0},
             "total_tokens": tokens[0] + tokens[2]}
    expires_after = None if gw.output_expires_s is None else {"anchor": "created_at", "seconds": gw.output_expires_s}
    obj = {
        "id": gw.id, "object": "batch", "endpoint": gw.endpoint, "errors": errors,
        "input_file_id": gw.input_file_id, "completion_window": gw.completion_window, "status": status,
        "output_file_id": gw.output_file_id, "error_file_id": gw.error_file_id,
        "created_at": gw.created_at, "in_progress_at": in_progress_at, "expires_at": gw.expires_at,
        "finalizing_at": finalizing_at, "completed_at": ended["completed_at"], "failed_at": ended["failed_at"],
        "expired_at": ended["expired_at"], "cancelling_at": cancelling_at, "cancelled_at": ended["cancelled_at"],
        "request_counts": counts, "metadata": gw.metadata, "model": gw.model, "usage": usage,
        "output_expires_after": expires_after, "webhook_url": gw.webhook_url,
        "retry_of": gw.retry_of, "retried_by": gw.retried_by,
    }
    for name, value in obj.items():  # OpenAI's timestamps are whole unix seconds
        if name.endswith("_at") and value is not None:
            obj[name] = int(value)
    return obj
