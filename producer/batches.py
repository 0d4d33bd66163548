"""Batches: an OpenAI Batch JSONL file as one record plus one job per line, with counts and export."""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import structlog

from producer import models, openai_batch, vectors
from producer.batch_file import BatchFileReader
from producer.batch_spool import Progress, Spooled, feed, name_of, spool_batch
from producer.client_api import ClientApi
from producer.openai_batch import EMBEDDINGS
from producer.submit_pipe import SubmitPipe
from protocol import scripts
from protocol.errors import BatchNotFound, InvalidBatch, TokenbusError, WaitTimeout
from protocol.models import BatchStatus, JobRequest, batch_job_id, check_batch_id, check_job_id
from protocol.priority import Priority
from protocol.records import BatchRecord
from protocol.scripts import CHUNK

log = structlog.get_logger("tokenbus.producer")


def read_batch(source: str | Path | Iterable[str]) -> tuple[str, list[tuple[str, JobRequest]], str | None]:
    """(endpoint, [(custom_id, request)], the file name when source is a path), the file read as a stream
    by the one batch-file reader (producer/batch_file.py); InvalidBatch naming each bad line."""
    reader = BatchFileReader(keep=True, max_errors=None)
    for _ in feed(reader, source):
        pass
    problem = reader.problem("nothing was submitted")
    if problem:
        raise InvalidBatch(problem, line_errors=reader.errors)
    return reader.endpoint or "", reader.parsed, name_of(source)


def submit_batch(
    client: ClientApi,
    source: str | Path | Iterable[str] | Spooled,
    *,
    batch_id: str | None = None,
    model: str | None = None,
    priority: str = Priority.bulk,
    on_progress: Progress | None = None,
    spool_dir: str | Path | None = None,
) -> BatchRecord:
    """Validate the whole input, then write the batch record and one job per line (ids `{batch_id}-{i}`).

    Re-running with the same batch_id finishes an interrupted submit and never duplicates a job.
    model: None keeps each line's body.model, "" drops it (any worker model), a name replaces it.
    priority: bulk unless given (a batch is offline work); its jobs wait on one queue of their own,
    `{ns}:q:{priority}:{batch_id}`, which takes turns with the other batches of that priority. A resumed
    submit keeps the priority the batch was created with.
    Memory stays flat in the file's size: pass 1 validates the input into a spool file on disk (spool_dir,
    default the system's temporary directory; producer/batch_spool.py), pass 2 streams it to Redis with chunks
    in flight (producer/submit_pipe.py). on_progress(stage, done, total): "validate" in bytes, "enqueue" in jobs.
    source a Spooled (validated already: the gateway's upload kept its spool, batch_spool.open_spool): its
    requests are sent as they are, with the priority they were validated with; nothing is read or validated
    again. One that has changed since raises InvalidBatch after the jobs before it were written.
    A batch may mix models: each line waits on its own model's queue. One naming a model nobody declared
    refuses the whole batch before anything is written (ModelNotFound).
    """
    priority = Priority(priority).value
    k = client.keys
    existing = client.redis.hgetall(k.batch(check_job_id(batch_id, "batch id"))) if batch_id else {}
    if isinstance(source, Spooled):
        priority = source.priority
    created = (existing.get("priority") or priority) if existing else priority
    if created != priority and isinstance(source, Spooled):
        source.close()
        raise InvalidBatch(f"batch {batch_id!r} was created with priority {created}; these requests were "
                           f"validated for {priority}. Use a new batch id")
    priority = created  # a resumed submit keeps the batch's priority
    started = time.perf_counter()
    spooled = source if isinstance(source, Spooled) else spool_batch(source, model, priority, on_progress, spool_dir)
    try:
        return _submit_spooled(client, spooled, batch_id, existing, priority, on_progress,
                               validate_s=time.perf_counter() - started)
    finally:
        spooled.close()


def _submit_spooled(client: ClientApi, spooled: Spooled, batch_id: str | None, existing: dict[str, str],
                    priority: str, on_progress: Progress | None, validate_s: float) -> BatchRecord:
    started = time.perf_counter()
    k, total, endpoint = client.keys, spooled.total, spooled.endpoint
    batch_id = check_batch_id(batch_id, total) if batch_id else f"batch_{uuid.uuid4().hex}"
    if existing:
        record = BatchRecord.from_record(existing)
        if record.total != total or record.endpoint != endpoint:
            raise InvalidBatch(f"batch {batch_id!r} already exists with {record.total} {record.endpoint} "
                               f"requests; this input has {total} {endpoint} requests. "
                               f"Use a new batch id")
        if record.status != BatchStatus.validating:
            return record
        if client.redis.llen(k.batch_jobs(batch_id)) != total:  # the first submit stopped inside the list
            client.redis.delete(k.batch_jobs(batch_id))
            _write_job_list(client, batch_id, total)
    else:
        ids = models.resolve(client.redis, k, spooled.models or ())  # ModelNotFound: nothing written yet
        for mid in {ids[m] for m in spooled.models or ("",)}:  # each model's queues hold at most max_queue_len
            client.check_capacity(total, mid)
        _check_ids_free(client, batch_id, total)
        pipe = client.redis.pipeline(transaction=True)
        pipe.hset(k.batch(batch_id), mapping={
            "id": batch_id, "status": BatchStatus.validating.value, "endpoint": endpoint,
            "total": total, "finished": 0, "failed": 0, "cancelled": 0, "created_at": time.time(),
            "input_file": spooled.input_file or "", "priority": priority,
            "queue": k.queue(priority, batch_id),
        })
        pipe.delete(k.batch_jobs(batch_id))
        pipe.execute()
        _write_job_list(client, batch_id, total)
    progress = None if on_progress is None else (lambda n: on_progress("enqueue", n, total))
    with SubmitPipe(client.redis, k, client.max_queue_len, client.result_ttl, on_chunk=progress) as pipe:
        add = pipe.add_job
        for i, custom_id, model, request_json in spooled.requests():  # in prefix order (producer/prefix_order.py)
            add(batch_job_id(batch_id, i), request_json, batch_id, custom_id, priority, model)
        pipe.close()
    scripts.script(scripts.START_BATCH)(keys=[k.batch(batch_id)], args=[time.time()], client=client.redis)
    log.info("batch_submitted", batch_id=batch_id, endpoint=endpoint, total=total, input_file=spooled.input_file,
             validate_s=round(validate_s, 2), enqueue_s=round(time.perf_counter() - started, 2))
    return get_batch(client, batch_id)


def _write_job_list(client: ClientApi, batch_id: str, total: int) -> None:
    """RPUSH the batch's job ids `{batch_id}-{i}` in input order onto its (empty) job list, CHUNK a call: the
    client holds no more ids than its pipe holds jobs in flight. A submit stopped half-way leaves a short list,
    which the re-submit writes again (docs/protocol.md, "Submitting a batch")."""
    for start in range(0, total, CHUNK):
        client.redis.rpush(client.keys.batch_jobs(batch_id),
                           *(batch_job_id(batch_id, i) for i in range(start, min(total, start + CHUNK))))


def _check_ids_free(client: ClientApi, batch_id: str, total: int) -> None:
    """InvalidBatch if a job `{batch_id}-{i}` exists already (a plain job, or a batch that expired): the new
    batch would adopt that job's status and result instead of running its own request. One EXISTS per
    CHUNK ids; the taken ones are named only when some are."""
    taken: list[str] = []
    record = client.keys.job("")  # + job id: its record's key (built once, not per id)
    for start in range(0, total, CHUNK):
        ids = [batch_job_id(batch_id, i) for i in range(start, min(total, start + CHUNK))]
        if client.redis.exists(*[record + j for j in ids]):
            pipe = client.redis.pipeline(transaction=False)
            for jid in ids:
                pipe.exists(client.keys.job(jid))
            taken += [jid for jid, n in zip(ids, pipe.execute(), strict=True) if n]
            if len(taken) > 5:
                break
    if taken:
        shown = ", ".join(repr(t) for t in taken[:5]) + (" and more" if len(taken) > 5 else "")
        raise InvalidBatch(f"batch {batch_id!r} cannot be submitted: its job ids are taken by other jobs "
                           f"({shown}); nothing was submitted. Use another batch id")


def get_batch(client: ClientApi, batch_id: str) -> BatchRecord:
    rec = client.redis.hgetall(client.keys.batch(batch_id))
    if not rec:
        raise BatchNotFound(f"batch {batch_id!r} not found in namespace {client.keys.ns!r}: never "
                            f"submitted, or it ended more than result_ttl seconds ago and expired")
    return BatchRecord.from_record(rec)


def iter_batch_job_ids(client: ClientApi, batch_id: str, chunk: int = CHUNK) -> Iterator[list[str]]:
    """The batch's job ids in input order, `chunk` at a time (a million ids never sit in memory at once)."""
    key, at = client.keys.batch_jobs(batch_id), 0
    while ids := client.redis.lrange(key, at, at + chunk - 1):
        yield ids
        at += len(ids)


def cancel_batch(client: ClientApi, batch_id: str) -> BatchRecord:
    """Mark the batch cancelling and cancel each job: queued ones end now, running ones are aborted."""
    k = client.keys
    now = time.time()
    status = scripts.script(scripts.CANCEL_BATCH)(keys=[k.batch(batch_id)], args=[now], client=client.redis)
    if not status:
        get_batch(client, batch_id)  # raises BatchNotFound
    if status != BatchStatus.cancelling:
        return get_batch(client, batch_id)
    jobs = 0
    for chunk in iter_batch_job_ids(client, batch_id):
        jobs += len(chunk)
        pipe = client.redis.pipeline(transaction=False)
        for jid in chunk:
            scripts.cancel_job(pipe, k, jid, now, client.result_ttl)
        never_submitted = [jid for jid, out in zip(chunk, pipe.execute(), strict=True) if out == ""]
        # A job never written (an interrupted submit) will never end on its own: count it as cancelled.
        for _ in never_submitted:
            scripts.bump_batch(client.redis, k, batch_id, "cancelled", now, client.result_ttl)
    log.info("batch_cancel_requested", batch_id=batch_id, jobs=jobs)
    return get_batch(client, batch_id)


def wait_batch(
    client: ClientApi,
    batch_id: str,
    timeout: float | None = None,
    on_progress: Callable[[BatchRecord], None] | None = None,
) -> BatchRecord:
    """Block until the batch is completed or cancelled, waking on job events (XREAD BLOCK), not polling."""
    deadline = None if timeout is None else time.monotonic() + timeout
    last_id = client.events_last_id()
    while True:
        record = get_batch(client, batch_id)
        if on_progress:
            on_progress(record)
        if record.is_terminal:
            return record
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            raise WaitTimeout(f"batch {batch_id} is still {record.status.value} after {timeout} s "
                              f"({record.done}/{record.total} jobs ended)")
        block = client.max_block_s if deadline is None else min(client.max_block_s, deadline - now)
        resp = client.redis.xread({client.keys.events: last_id}, count=10_000,
                                  block=max(1, int(block * 1000)))
        for _stream, entries in resp or []:
            last_id = entries[-1][0]
        if resp:
            time.sleep(0.2)  # under a stream of events, refresh the record a few times a second at most


def export_batch(client: ClientApi, batch_id: str, out: str | Path, *, allow_partial: bool = False,
                 on_progress: Progress | None = None, drop_vectors: bool = False) -> int:
    """Write OpenAI Batch output lines (input order) to `out`; returns how many lines were written.

    drop_vectors: once the file is complete, delete the exported embedding jobs' vectors from Redis (the big
    part of an embedding batch; the records stay, small, until their result_ttl).

    Refuses a batch that has not ended unless allow_partial (then jobs still queued/running are left out).
    Streams: CHUNK records read, written and dropped at a time. on_progress("export", jobs, total).
    """
    record = get_batch(client, batch_id)
    if not record.is_terminal and not allow_partial:
        raise TokenbusError(f"batch {batch_id} is {record.status.value} ({record.done}/{record.total} jobs "
                            f"ended); wait for it (tokenbus batch wait {batch_id}) or export with --partial")
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    written = 0
    with tmp.open("w", encoding="utf-8") as f:
        for chunk in iter_batch_job_ids(client, batch_id):
            if on_progress is not None:
                on_progress("export", len(chunk), record.total)
            # an embedding batch's vectors: one GET per job, pipelined, as its records are read
            blobs = vectors.read_blobs(client.redis, client.keys, chunk) if record.endpoint == EMBEDDINGS \
                else [None] * len(chunk)
            for jid, job, blob in zip(chunk, client.get_many(chunk), blobs, strict=True):
                if job is not None and not job.done:
                    continue
                f.write(json.dumps(openai_batch.output_line(job, jid, record.endpoint, blob), ensure_ascii=False))
                f.write("\n")
                written += 1
    os.replace(tmp, out)
    if drop_vectors and record.endpoint == EMBEDDINGS:
        for chunk in iter_batch_job_ids(client, batch_id):
            client.redis.delete(*[client.keys.vectors(jid) for jid in chunk])
    log.info("batch_exported", batch_id=batch_id, lines=written, out=str(out), dropped_vectors=drop_vectors)
    return written
