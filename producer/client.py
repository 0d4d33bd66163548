"""Client: submit jobs to the Redis stream, read their records, wait for them, cancel them."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import redis
import structlog

from producer import batches, models, vectors, waiting
from producer.waiting import TokenChunk
from protocol import scripts
from protocol.connection import redis_from_url, socket_timeout
from protocol.errors import InvalidJob, JobNotFound, QueueFull, TokenbusError, listing
from protocol.keys import DEFAULT_NAMESPACE, Keys
from protocol.models import (
    DEFAULT_MAX_QUEUE_LEN,
    DEFAULT_REDIS_URL,
    DEFAULT_RESULT_TTL,
    TERMINAL_STATUSES,
    Job,
    JobRequest,
    check_job_id,
    validate_request,
)
from protocol.priority import PRIORITIES
from protocol.records import BatchRecord, QueueInfo, WorkerInfo

log = structlog.get_logger("tokenbus.producer")

class Client:
    """A producer handle on one Redis database and namespace.

    max_queue_len / result_ttl: explicit values win, then the `{ns}:config` hash, then the defaults.
    """

    def __init__(
        self,
        url: str = DEFAULT_REDIS_URL,
        *,
        namespace: str = DEFAULT_NAMESPACE,
        max_queue_len: int | None = None,
        result_ttl: int | None = None,
        redis_client: redis.Redis | None = None,
    ) -> None:
        # encoding_errors="replace": a record holding bytes that are not UTF-8 (a raw submit that skipped this
        # client) still reads back, with U+FFFD, instead of raising UnicodeDecodeError.
        self.redis = redis_client or redis_from_url(url, decode_responses=True, encoding_errors="replace")
        if not self.redis.get_encoder().decode_responses:
            raise TokenbusError("Client needs a redis client made with decode_responses=True")
        self.keys = Keys(namespace)
        self._max_queue_len = max_queue_len
        self._result_ttl = result_ttl
        self._config_read = False

    # ---- configuration -------------------------------------------------------------------------
    def _read_config(self) -> None:
        if self._config_read:
            return
        cfg = self.redis.hgetall(self.keys.config)
        if self._max_queue_len is None:
            self._max_queue_len = int(cfg.get("max_queue_len", DEFAULT_MAX_QUEUE_LEN))
        if self._result_ttl is None:
            self._result_ttl = int(cfg.get("result_ttl", DEFAULT_RESULT_TTL))
        self._config_read = True

    @property
    def max_queue_len(self) -> int:
        self._read_config()
        return self._max_queue_len

    @property
    def result_ttl(self) -> int:
        self._read_config()
        return self._result_ttl

    # ---- submit --------------------------------------------------------------------------------
    def submit(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict[str, Any]] | None = None,
        prompt_token_ids: list[int] | None = None,
        job_id: str | None = None,
        **params: Any,
    ) -> str:
        """Queue one job; returns its id. The same job_id twice yields one job (the first request wins)."""
        fields = {"prompt": prompt, "messages": messages, "prompt_token_ids": prompt_token_ids}
        fields = {k: v for k, v in fields.items() if v is not None} | params
        return self.submit_many([fields], job_ids=[job_id])[0]

    def submit_embedding(self, input: str | list[Any], *, job_id: str | None = None, **params: Any) -> str:
        """Queue one embedding job (OpenAI's embeddings request: `input` and model, dimensions, truncate,
        encoding_format, embedding_dtype); returns its id. Read its vectors with `vectors` once it ended."""
        return self.submit_many([{"input": input} | params], job_ids=[job_id])[0]

    def embed(self, input: str | list[Any], *, timeout: float | None = None, **params: Any) -> list[list[float]]:
        """Embed `input` (a string, strings, token ids or lists of them) and wait: one vector per input, in
        order. TokenbusError saying why when the job failed (e.g. unsupported_kind: the model does not embed)."""
        job = self.wait(self.submit_embedding(input, **params), timeout=timeout)
        return self.vectors(job)

    def vectors(self, job: Job | str) -> list[list[float]]:
        """A finished embedding job's vectors (floats, one per input in order)."""
        job = self.get(job) if isinstance(job, str) else job
        return vectors.vectors_of(job, vectors.read_blobs(self.redis, self.keys, [job.id])[0])

    def submit_many(
        self,
        requests: Iterable[dict[str, Any] | JobRequest],
        *,
        job_ids: Iterable[str | None] | None = None,
        chunk_size: int = scripts.CHUNK,
    ) -> list[str]:
        """Validate every request, then queue them all, pipelined. Nothing is written if any is invalid.

        A dict may carry its own "job_id"; otherwise ids come from job_ids or are generated.
        """
        requests = list(requests)
        ids = list(job_ids) if job_ids is not None else [None] * len(requests)
        if len(ids) != len(requests):
            raise InvalidJob(f"job_ids has {len(ids)} ids for {len(requests)} requests")
        pending, errors = [], []
        for i, (req, jid) in enumerate(zip(requests, ids, strict=True)):
            if isinstance(req, dict) and "job_id" in req:
                req = dict(req)
                jid = req.pop("job_id")
            try:
                jid = check_job_id(jid) if jid is not None else uuid.uuid4().hex
                request = validate_request(req)
                pending.append(scripts.PendingJob(jid, request.to_json(), priority=request.priority,
                                                  model=request.model or ""))
            except InvalidJob as err:
                errors.append(f"request {i}: {err}" if len(requests) > 1 else str(err))
        if errors:
            raise InvalidJob(_many_errors(errors, len(requests)))
        return self.enqueue(pending, chunk_size=chunk_size)

    def enqueue(self, jobs: list[scripts.PendingJob], chunk_size: int = scripts.CHUNK) -> list[str]:
        """Write validated jobs (SUBMIT_JOB per job, EVALSHA pipelined in chunks) to their model's and priority's
        queue. Returns their ids. ModelNotFound, with nothing written, when one names an undeclared model."""
        if not jobs:
            return []
        if len(jobs) > 1:  # one job: the script's own checks are exact (and let an idempotent resubmit in)
            ids = models.resolve(self.redis, self.keys, {j.model for j in jobs})
            per_model: dict[str, int] = {}
            for j in jobs:
                per_model[ids[j.model]] = per_model.get(ids[j.model], 0) + 1
            for mid, n in per_model.items():
                self.check_capacity(n, mid)
        limit = self.max_queue_len
        submit = scripts.script(scripts.SUBMIT_JOB)
        accepted: list[str] = []
        for start in range(0, len(jobs), chunk_size):
            chunk = jobs[start:start + chunk_size]
            now = time.time()
            pipe = self.redis.pipeline(transaction=False)
            for job in chunk:
                keys, args = scripts.submit_args(self.keys, job, now, limit, self.result_ttl)
                submit(keys=keys, args=args, client=pipe)
            for job, (code, value) in zip(chunk, pipe.execute(), strict=True):
                if int(code) == scripts.NOT_DECLARED:  # removed meanwhile, or a one-job submit
                    raise scripts.model_not_found(self.keys, job.model, value)
                if int(code) == -2:
                    raise InvalidJob(
                        f"job id {job.job_id!r} of batch {job.batch_id!r} is taken by another job (batch "
                        f"{value or 'none'}); the batch would adopt that job's result. Use another batch id "
                        f"({len(accepted)} of this call's jobs were queued before this one)")
                if int(code) == -1:
                    log.warning("queue_full", namespace=self.keys.ns, depth=int(value), limit=limit,
                                accepted=len(accepted), refused=len(jobs) - len(accepted))
                    raise QueueFull(
                        f"queue full: {value} jobs queued in namespace {self.keys.ns!r} >= max_queue_len {limit}; "
                        f"{len(jobs) - len(accepted)} of {len(jobs)} jobs were refused (not queued), "
                        f"{len(accepted)} were queued (see .accepted). Wait for the workers to drain the "
                        f"queue or raise max_queue_len",
                        accepted=accepted,
                    )
                accepted.append(job.job_id)
        return accepted

    def check_capacity(self, n: int, model_id: str = "") -> None:
        """QueueFull unless n more jobs fit under max_queue_len in the queues of the model with this id ('' =
        the default queues) now (checked before writing anything)."""
        limit = self.max_queue_len
        depth = scripts.queue_depth(self.redis, self.keys.for_model(model_id)) if limit > 0 else 0
        if limit > 0 and depth + n > limit:
            whose = f"model {model_id!r}'s queues" if model_id else "the default queues"
            raise QueueFull(
                f"queue full: {depth} jobs queued in {whose} of namespace {self.keys.ns!r}, max_queue_len {limit}, "
                f"so {n} more "
                f"do not fit; nothing was submitted. Wait for the workers to drain the queue, submit fewer, "
                f"or raise max_queue_len (Client(max_queue_len=...) or "
                f"HSET {self.keys.config} max_queue_len N)"
            )

    # ---- read ----------------------------------------------------------------------------------
    def get(self, job_id: str) -> Job:
        job = self.get_many([job_id])[0]
        if job is None:
            raise JobNotFound(self._not_found(job_id))
        return job

    def get_many(self, job_ids: Iterable[str], ended_requests_only: bool = False) -> list[Job | None]:
        """Records in the order asked; None where there is no record (never submitted, or expired).
        ended_requests_only: a job that has not ended comes without its request (no XRANGE for it): what a
        reader that keeps only the ended ones (as_completed) needs."""
        job_ids = list(job_ids)
        out: list[Job | None] = []
        for start in range(0, len(job_ids), scripts.CHUNK):
            pipe = self.redis.pipeline(transaction=False)
            for jid in job_ids[start:start + scripts.CHUNK]:
                pipe.hgetall(self.keys.job(jid))
            records = pipe.execute()
            for jid, rec in zip(job_ids[start:start + scripts.CHUNK], records, strict=True):
                if rec:
                    rec.setdefault("id", jid)  # the key names the job: SUBMIT_JOB writes no `id` field
            self._add_requests([rec for rec in records if rec and (not ended_requests_only
                                                                   or rec.get("status") in TERMINAL_STATUSES)])
            out.extend(Job.from_record(rec) if rec else None for rec in records)
        return out

    def _add_requests(self, records: list[dict[str, str]]) -> None:
        """A job that has not ended keeps its request in its queue entry only (docs/protocol.md, "Job record"):
        read it from there (one XRANGE each, pipelined) for the records that hold none."""
        need = [rec for rec in records if rec and not rec.get("request") and rec.get("entry_id") and rec.get("queue")]
        if not need:
            return
        pipe = self.redis.pipeline(transaction=False)
        for rec in need:
            pipe.xrange(rec["queue"], rec["entry_id"], rec["entry_id"])
        for rec, found in zip(need, pipe.execute(raise_on_error=False), strict=True):
            if isinstance(found, list) and found:
                rec["request"] = found[0][1].get("request", "")

    def _not_found(self, job_id: str) -> str:
        return waiting.not_found(self, job_id)

    # ---- wait (producer/waiting.py) -----------------------------------------------------------
    def wait(self, job_id: str, timeout: float | None = None) -> Job:
        """Block until the job ends (finished, failed or cancelled); WaitTimeout after `timeout` seconds."""
        for job in self.as_completed([job_id], timeout=timeout):
            return job
        raise AssertionError("unreachable")

    def as_completed(
        self, job_ids: Iterable[str], timeout: float | None = None, resync_every: float = 5.0
    ) -> Iterator[Job]:
        """Yield each job once it has ended, in the order they end (already-ended ones first): XREAD of
        `{ns}:events`, not polling (waiting.as_completed)."""
        return waiting.as_completed(self, job_ids, timeout, resync_every)

    @property
    def max_block_s(self) -> float:
        """Longest XREAD BLOCK: under the socket timeout (redis-py 8 defaults to 5 s), at most 1 s."""
        timeout = socket_timeout(self.redis)
        return 1.0 if timeout is None else max(0.01, min(1.0, 0.5 * timeout))

    def events_last_id(self) -> str:
        last = self.redis.xrevrange(self.keys.events, count=1)
        return last[0][0] if last else "0-0"

    # ---- streaming ----------------------------------------------------------------------------
    def stream(self, job_id: str, timeout: float | None = None) -> Iterator[TokenChunk]:
        """Yield a `stream=True` job's output as the worker publishes it; ends with the chunk marked done
        (waiting.stream)."""
        return waiting.stream(self, job_id, timeout)

    # ---- cancel --------------------------------------------------------------------------------
    def cancel(self, job_id: str) -> str:
        """'cancelled' (it was queued), 'cancelling' (running: its worker aborts it), or its final status."""
        status = scripts.cancel_job(self.redis, self.keys, job_id, result_ttl=self.result_ttl)
        if status == "":
            raise JobNotFound(self._not_found(job_id))
        return status

    # ---- info ----------------------------------------------------------------------------------
    def info(self) -> QueueInfo:
        """The namespace at a glance, in a fixed number of round trips whatever the number of batches and jobs:
        the depth counter, the registries' sizes, the workers' heartbeats."""
        k = self.keys
        beats = models.live_heartbeats(self.redis, k)
        per_model = models.model_infos(self.redis, k, beats)
        pipe = self.redis.pipeline(transaction=False)
        pipe.xlen(k.dead).scard(k.cancel)
        for m in per_model:
            for p in PRIORITIES:
                pipe.xlen(k.for_model(m.id).queue(p)).zcard(k.for_model(m.id).registry(p))
        dead, cancel_requested, *sizes = pipe.execute()
        queues = sum(1 for n in sizes[::2] if n) + sum(sizes[1::2])  # non-empty loose queues + live batch queues
        depth = sum(m.queue_depth for m in per_model)
        pending = sum(m.pending for m in per_model)
        by_priority = {p.value: sum(m.by_priority.get(p.value, 0) for m in per_model) for p in PRIORITIES}
        workers = [WorkerInfo(name=n, alive=hb is not None, heartbeat=hb) for n, hb in beats.items()]
        return QueueInfo(namespace=k.ns, queue_depth=depth, pending=pending, waiting=max(0, depth - pending),
                         by_priority=by_priority, queues=queues,
                         consumers=sum(w.alive for w in workers), workers=workers, dead_letters=dead,
                         cancel_requested=cancel_requested, max_queue_len=self.max_queue_len,
                         result_ttl=self.result_ttl, models=per_model)

    # ---- batches (see producer/batches.py) -----------------------------------------------------
    def submit_batch(self, source: str | Path | Iterable[str], **kwargs: Any) -> BatchRecord:
        return batches.submit_batch(self, source, **kwargs)

    def get_batch(self, batch_id: str) -> BatchRecord:
        return batches.get_batch(self, batch_id)

    def cancel_batch(self, batch_id: str) -> BatchRecord:
        return batches.cancel_batch(self, batch_id)

    def export_batch(self, batch_id: str, out: str | Path, **kwargs: Any) -> int:
        return batches.export_batch(self, batch_id, out, **kwargs)

    def close(self) -> None:
        self.redis.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _many_errors(errors: list[str], total: int) -> str:
    if total == 1:
        return errors[0]
    return f"{len(errors)} of {total} requests are invalid; nothing was submitted:{listing(errors)}"
