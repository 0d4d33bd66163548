"""Jobs submitted through the gateway: ownership, OpenAI-shaped results and errors (the job object of
GET /v1/jobs/{id}, the HTTP error of a job, the status of a batch error line)."""

from __future__ import annotations

from typing import Any

from gateway.context import GatewayContext
from gateway.errors import APIError, not_found
from producer.openai_batch import response_body
from protocol.models import JOB_ID_RE, Job, JobStatus

OWNERSHIP_SLACK_S = 24 * 3600  # the ownership record outlives the job's record (result_ttl) by this


def owned_job(ctx: GatewayContext, who: str, job_id: str) -> tuple[Job, str]:
    """(job, endpoint) for a job of this owner: its own chat/completion job or a job of one of its batches."""
    if not JOB_ID_RE.match(job_id):  # also keeps ids like `x:tokens` from addressing other keys
        raise not_found("job", job_id)
    owner_of, endpoint = ctx.redis.hmget(ctx.gkeys.job(job_id), "owner", "endpoint")
    job = ctx.client.get_many([job_id])[0]
    if owner_of is None and job is not None and job.batch_id:
        owner_of, endpoint = ctx.redis.hmget(ctx.gkeys.batch(job.batch_id), "owner", "endpoint")
    if job is None or owner_of != who:
        raise not_found("job", job_id)
    return job, endpoint


def job_error(job: Job) -> APIError:
    """The HTTP error for a job that ended without a result."""
    code = job.error_code or job.status.value
    message = job.error or f"job {job.id} ended {job.status.value}"
    return error_for(code, message, job.id)


def error_for(code: str | None, message: str, job_id: str | None = None) -> APIError:
    """The HTTP error for a job's error code (also the status_code of a batch error-file line)."""
    if code == "model_mismatch":
        return APIError(404, message, param="model", code="model_not_found")
    # the request's own fault: retrying will not help
    if code in ("invalid_request", "grammar_too_costly", "unsupported_kind"):
        return APIError(400, message, code=code)
    if code == "cancelled":
        return APIError(409, message, code="cancelled")
    where = f" (job {job_id})" if job_id else ""
    return APIError(500, f"{message}{where}; retry the request", code=code, type="server_error")


def job_object(job: Job, endpoint: str) -> dict[str, Any]:
    """GET /v1/jobs/{id}: the record's state, and the OpenAI response body once finished."""
    out: dict[str, Any] = {
        "id": job.id, "object": "tokenbus.job", "status": job.status.value, "endpoint": endpoint,
        "created_at": job.created_at, "started_at": job.started_at, "first_token_at": job.first_token_at,
        "finished_at": job.finished_at, "attempts": job.attempts, "batch_id": job.batch_id,
        "custom_id": job.custom_id, "response": None, "error": None,
    }
    if job.status == JobStatus.finished and job.result is not None and job.result.embeddings is not None:
        out["embeddings"] = job.result.embeddings  # the vectors: POST /v1/embeddings answers them, or the batch
    elif job.status == JobStatus.finished and job.result is not None:
        out["response"] = response_body(job, endpoint)
    elif job.done:
        out["error"] = job_error(job).body()["error"]
    return out
