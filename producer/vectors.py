"""An embedding job's vectors read back: the raw bytes of `{ns}:job:{id}:vectors` (protocol/embeddings.py), and
their OpenAI shapes (the embeddings response and its `data` list).

Every producer-side client decodes replies as text; these reads ask redis-py not to (NEVER_DECODE), so the bytes
arrive as the worker wrote them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import redis
from redis.client import NEVER_DECODE

from protocol.embeddings import encode_vector, unpack_vector
from protocol.errors import TokenbusError
from protocol.keys import Keys
from protocol.models import Job, JobStatus

CHUNK = 256  # vectors keys a pipeline reads


def read_blobs(r: redis.Redis, keys: Keys, job_ids: Iterable[str]) -> list[bytes | None]:
    """Each job's vectors blob, in order; None where it has none (not an embedding job, not ended, expired)."""
    job_ids = list(job_ids)
    out: list[bytes | None] = []
    for start in range(0, len(job_ids), CHUNK):
        pipe = r.pipeline(transaction=False)
        for jid in job_ids[start:start + CHUNK]:
            pipe.execute_command("GET", keys.vectors(jid), **{NEVER_DECODE: True})
        out.extend(pipe.execute())
    return out


def check_embedding(job: Job, blob: bytes | None) -> None:
    """TokenbusError unless the job is a finished embedding job whose vectors are still in Redis."""
    if job.status != JobStatus.finished:
        raise TokenbusError(f"job {job.id} is {job.status.value}, not finished: {job.error or 'no vectors'}")
    result = job.result
    if result is None or result.embeddings is None:
        raise TokenbusError(f"job {job.id} is not an embedding job (its request has no `input`)")
    if blob is None:
        raise TokenbusError(f"job {job.id}'s vectors are gone from Redis (expired, or dropped after export); "
                            "submit it again")


def vectors_of(job: Job, blob: bytes | None) -> list[list[float]]:
    """A finished embedding job's vectors as lists of floats, one per input in order."""
    check_embedding(job, blob)
    res = job.result
    assert res is not None and blob is not None and res.embeddings is not None
    return [unpack_vector(blob, i, res.embedding_dim or 0, res.embedding_dtype or "float32")
            for i in range(res.embeddings)]


def embedding_data(job: Job, blob: bytes | None, encoding_format: str | None = None) -> list[dict[str, Any]]:
    """OpenAI's `data`: [{object: embedding, index, embedding}], floats or base64 as the request asked."""
    check_embedding(job, blob)
    res = job.result
    assert res is not None and blob is not None and res.embeddings is not None
    fmt = encoding_format or (job.request or {}).get("encoding_format", "float")
    dim, dtype = res.embedding_dim or 0, res.embedding_dtype or "float32"
    return [{"object": "embedding", "index": i, "embedding": encode_vector(blob, i, dim, dtype, fmt)}
            for i in range(res.embeddings)]


def embeddings_response(job: Job, blob: bytes | None, encoding_format: str | None = None) -> dict[str, Any]:
    """The body OpenAI's POST /v1/embeddings answers: {object: list, data, model, usage}."""
    data = embedding_data(job, blob, encoding_format)
    res = job.result
    assert res is not None
    tokens = res.usage.prompt_tokens
    return {"object": "list", "data": data, "model": res.model or "",
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
