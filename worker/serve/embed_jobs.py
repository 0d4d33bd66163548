"""Embedding jobs inside the engine: one job, one engine request per input.

An embedding job (protocol/embeddings.py) of N inputs seats N prefill-only requests `{job_id}#{i}` (job ids hold
no '#', so these never collide with a job's own id) that the scheduler batches with everything else. The job
ends when its last input's vector arrives: the vectors packed as little-endian bytes in input order (float32, or
float16 when the job asks), the result naming their count, width and dtype, and usage.prompt_tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from protocol.models import JobResult, Usage
from worker.serve.messages import StartedJob

SEP = "#"
_NUMPY_DTYPE = {"float32": "<f4", "float16": "<f2"}  # little-endian whatever the host


@dataclass
class _Group:
    job: StartedJob
    vectors: list[bytes | None]
    prompt_tokens: int = 0
    dim: int = 0
    left: int = field(init=False)

    def __post_init__(self) -> None:
        self.left = len(self.vectors)


def engine_id(job_id: str, index: int) -> str:
    return f"{job_id}{SEP}{index}"


def job_of(request_id: str) -> str:
    """The job an engine request belongs to (its own id for a generation)."""
    return request_id.split(SEP, 1)[0]


class EmbedJobs:
    """The embedding jobs this worker's engine holds, and the vectors each has so far."""

    def __init__(self) -> None:
        self.groups: dict[str, _Group] = {}

    def seat(self, engine: Any, job: StartedJob) -> None:
        """Add every input of the job to the engine, or none: the first refusal (InvalidRequest, with its code:
        an empty input, token ids outside the vocabulary, too long without truncate, a model that does not embed)
        takes back the inputs already added and is raised for the whole job."""
        from worker.engine.pooling import EmbedParams  # torch: only where the engine runs

        request = job.request
        params = EmbedParams(dimensions=request.dimensions, truncate=request.truncate)
        inputs = request.embed_inputs()
        added: list[str] = []
        try:
            for i, item in enumerate(inputs):
                rid = engine_id(job.job_id, i)
                engine.add_request(rid, item, params, priority=job.priority)
                added.append(rid)
        except BaseException:
            for rid in added:
                engine.abort(rid)
            raise
        self.groups[job.job_id] = _Group(job, [None] * len(inputs))

    def engine_ids(self, job_id: str) -> list[str]:
        """The engine requests of a job: its inputs' for an embedding job, else its own id."""
        group = self.groups.get(job_id)
        return [job_id] if group is None else [engine_id(job_id, i) for i in range(len(group.vectors))]

    def forget(self, job_id: str) -> None:
        self.groups.pop(job_id, None)

    def take(self, out: Any) -> str | None:
        """Keep a finished input's vector; the job's id once it has them all (then call `result`)."""
        job_id, _, index = out.request_id.partition(SEP)
        group = self.groups.get(job_id)
        if group is None or not index:
            return None
        dtype = _NUMPY_DTYPE[group.job.request.embedding_dtype]
        vector = out.embedding.numpy().astype(dtype, copy=False)
        group.vectors[int(index)] = vector.tobytes()
        group.dim = int(vector.shape[-1])
        group.prompt_tokens += len(out.prompt_token_ids)
        group.left -= 1
        return job_id if group.left == 0 else None

    def result(self, job_id: str, model: str) -> tuple[JobResult, bytes]:
        """The finished job's result and its packed vectors; the job leaves this registry."""
        group = self.groups.pop(job_id)
        blob = b"".join(v for v in group.vectors if v is not None)
        usage = Usage(prompt_tokens=group.prompt_tokens, total_tokens=group.prompt_tokens)
        result = JobResult(finish_reason="stop", usage=usage, model=model, embeddings=len(group.vectors),
                           embedding_dim=group.dim, embedding_dtype=group.job.request.embedding_dtype)
        return result, blob
