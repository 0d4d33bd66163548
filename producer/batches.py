"""Batches: an OpenAI Batch JSONL file as one record plus one job per line, with counts and export."""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol

import redis
import structlog

from producer import openai_batch
from protocol import scripts
from protocol.errors import BatchNotFound, InvalidBatch, InvalidJob, TokenbusError, WaitTimeout, listing
from protocol.keys import Keys
from protocol.models import GROUP, BatchStatus, Job, Priority, batch_job_id, check_batch_id
from protocol.records import BatchRecord
from protocol.scripts import CHUNK, PendingJob


class Client(Protocol):
    """What the batch functions use of producer.Client (named here so this module does not import it back)."""

    redis: redis.Redis
    keys: Keys

    @property
    def max_block_s(self) -> float: ...
    @property
    def result_ttl(self) -> int: ...

    def enqueue(self, jobs: list[PendingJob], chunk_size: int = CHUNK) -> list[str]: ...
    def check_capacity(self, n: int) -> None: ...
    def get_many(self, job_ids: Iterable[str]) -> list[Job | None]: ...
    def events_last_id(self) -> str: ...

log = structlog.get_logger("tokenbus.producer")


def read_lines(source: str | Path | Iterable[str]) -> tuple[list[tuple[int, str]], str | None]:
    """(line number, text) of each non-blank line, and the file name when source is a path."""
    if isinstance(source, str | Path):
        path = Path(source)
        if not path.is_file():
            raise InvalidBatch(f"batch input file {str(path)!r} does not exist or is not a file")
        with path.open(encoding="utf-8") as f:
            texts = f.read().splitlines()
        name: str | None = str(path)
    else:
        texts, name = list(source), None
    return [(n, t) for n, t in enumerate(texts, start=1) if t.strip()], name


def parse_batch(lines: list[tuple[int, str]]) -> tuple[str, list[tuple[str, dict]]]:
    """Validate every line: (endpoint, [(custom_id, request fields)]) or InvalidBatch naming each bad one."""
    parsed, errors = [], []
    endpoint, seen = None, {}
    for number, text in lines:
        try:
            line, fields = openai_batch.parse_line(text)
            if endpoint is None:
                endpoint = line.url
            elif line.url != endpoint:
                raise InvalidJob(f"url {line.url} differs from the batch's endpoint {endpoint} (line "
                                 f"{lines[0][0]}); one batch has one endpoint")
            if line.custom_id in seen:
                raise InvalidJob(f"custom_id {line.custom_id!r} already used on line {seen[line.custom_id]}")
            seen[line.custom_id] = number
            parsed.append((line.custom_id, fields))
        except InvalidJob as err:
            errors.append((number, str(err)))
    if errors:
        problems = listing([f"line {n}: {msg}" for n, msg in errors])
        raise InvalidBatch(f"{len(errors)} of {len(lines)} lines are invalid; nothing was submitted:{problems}",
                           line_errors=errors)
    if not parsed:
        raise InvalidBatch("the batch input has no requests (no non-blank lines)")
    return endpoint, parsed


def submit_batch(
    client: Client,
    source: str | Path | Iterable[str],
    *,
    batch_id: str | None = None,
    model: str | None = None,
    priority: str = Priority.bulk,
) -> BatchRecord:
    """Validate the whole input, then write the batch record and one job per line (ids `{batch_id}-{i}`).

    Re-running with the same batch_id finishes an interrupted submit and never duplicates a job.
    model: None keeps each line's body.model, "" drops it (any worker model), a name replaces it.
    priority: bulk unless given (a batch is offline work); its jobs wait on one queue of their own,
    `{ns}:q:{priority}:{batch_id}`, which takes turns with the other batches of that priority. A resumed
    submit keeps the priority the batch was created with.
    """
    priority = Priority(priority).value
    lines, input_file = read_lines(source)
    endpoint, parsed = parse_batch(lines)
    batch_id = check_batch_id(batch_id, len(parsed)) if batch_id else f"batch_{uuid.uuid4().hex}"
    k = client.keys
    existing = client.redis.hgetall(k.batch(batch_id))
    if existing:
        record = BatchRecord.from_record(existing)
        if record.total != len(parsed) or record.endpoint != endpoint:
            raise InvalidBatch(f"batch {batch_id!r} already exists with {record.total} {record.endpoint} "
                               f"requests; this input has {len(parsed)} {endpoint} requests. "
                               f"Use a new batch id")
        if record.status != BatchStatus.validating:
            return record
        priority = existing.get("priority") or priority
    job_ids = [batch_job_id(batch_id, i) for i in range(len(parsed))]
    if not existing:
        client.check_capacity(len(parsed))
        _check_ids_free(client, batch_id, job_ids)
    jobs = [PendingJob(jid, openai_batch.request_json(fields | {"priority": priority}, model), batch_id,
                       custom_id, priority)
            for jid, (custom_id, fields) in zip(job_ids, parsed, strict=True)]
    if not existing:
        pipe = client.redis.pipeline(transaction=True)
        pipe.hset(k.batch(batch_id), mapping={
            "id": batch_id, "status": BatchStatus.validating.value, "endpoint": endpoint,
            "total": len(jobs), "finished": 0, "failed": 0, "cancelled": 0, "created_at": time.time(),
            "input_file": input_file or "", "priority": priority,
            "queue": k.queue(priority, batch_id),
        })
        pipe.delete(k.batch_jobs(batch_id))
        for start in range(0, len(job_ids), CHUNK):
            pipe.rpush(k.batch_jobs(batch_id), *job_ids[start:start + CHUNK])
        pipe.execute()
    client.enqueue(jobs)
    scripts.script(scripts.START_BATCH)(keys=[k.batch(batch_id)], args=[time.time()], client=client.redis)
    log.info("batch_submitted", batch_id=batch_id, endpoint=endpoint, total=len(jobs), input_file=input_file)
    return get_batch(client, batch_id)


def _check_ids_free(client: Client, batch_id: str, job_ids: list[str]) -> None:
    """InvalidBatch if a job `{batch_id}-{i}` exists already (a plain job, or a batch that expired): the new
    batch would adopt that job's status and result instead of running its own request."""
    taken: list[str] = []
    for start in range(0, len(job_ids), CHUNK):
        chunk = job_ids[start:start + CHUNK]
        pipe = client.redis.pipeline(transaction=False)
        for jid in chunk:
            pipe.exists(client.keys.job(jid))
        taken += [jid for jid, n in zip(chunk, pipe.execute(), strict=True) if n]
    if taken:
        shown = ", ".join(repr(t) for t in taken[:5]) + (f" and {len(taken) - 5} more" if len(taken) > 5 else "")
        raise InvalidBatch(f"batch {batch_id!r} cannot be submitted: its job ids are taken by other jobs "
                           f"({shown}); nothing was submitted. Use another batch id")


def get_batch(client: Client, batch_id: str) -> BatchRecord:
    rec = client.redis.hgetall(client.keys.batch(batch_id))
    if not rec:
        raise BatchNotFound(f"batch {batch_id!r} not found in namespace {client.keys.ns!r}: never "
                            f"submitted, or it ended more than result_ttl seconds ago and expired")
    return BatchRecord.from_record(rec)


def batch_job_ids(client: Client, batch_id: str) -> list[str]:
    key, ids = client.keys.batch_jobs(batch_id), []
    while chunk := client.redis.lrange(key, len(ids), len(ids) + 10 * CHUNK - 1):
        ids.extend(chunk)
    return ids


def cancel_batch(client: Client, batch_id: str) -> BatchRecord:
    """Mark the batch cancelling and cancel each job: queued ones end now, running ones are aborted."""
    k = client.keys
    now = time.time()
    status = scripts.script(scripts.CANCEL_BATCH)(keys=[k.batch(batch_id)], args=[now], client=client.redis)
    if not status:
        get_batch(client, batch_id)  # raises BatchNotFound
    if status != BatchStatus.cancelling:
        return get_batch(client, batch_id)
    ids = batch_job_ids(client, batch_id)
    cancel = scripts.script(scripts.CANCEL_JOB)
    bump = scripts.script(scripts.BUMP_BATCH)
    for start in range(0, len(ids), CHUNK):
        chunk = ids[start:start + CHUNK]
        pipe = client.redis.pipeline(transaction=False)
        for jid in chunk:
            cancel(keys=[k.job(jid), k.jobs, k.events, k.cancel],
                   args=[GROUP, jid, now, client.result_ttl, k.ns, scripts.EVENTS_MAXLEN], client=pipe)
        never_submitted = [jid for jid, out in zip(chunk, pipe.execute(), strict=True) if out == ""]
        # A job never written (an interrupted submit) will never end on its own: count it as cancelled.
        for _ in never_submitted:
            bump(args=[k.ns, batch_id, "cancelled", now, client.result_ttl], client=client.redis)
    log.info("batch_cancel_requested", batch_id=batch_id, jobs=len(ids))
    return get_batch(client, batch_id)


def wait_batch(
    client: Client,
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


def export_batch(client: Client, batch_id: str, out: str | Path, *, allow_partial: bool = False) -> int:
    """Write OpenAI Batch output lines (input order) to `out`; returns how many lines were written.

    Refuses a batch that has not ended unless allow_partial (then jobs still queued/running are left out).
    """
    record = get_batch(client, batch_id)
    if not record.is_terminal and not allow_partial:
        raise TokenbusError(f"batch {batch_id} is {record.status.value} ({record.done}/{record.total} jobs "
                            f"ended); wait for it (tokenbus batch wait {batch_id}) or export with --partial")
    ids = batch_job_ids(client, batch_id)
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    written = 0
    with tmp.open("w", encoding="utf-8") as f:
        for start in range(0, len(ids), CHUNK):
            chunk = ids[start:start + CHUNK]
            for jid, job in zip(chunk, client.get_many(chunk), strict=True):
                if job is not None and not job.done:
                    continue
                f.write(json.dumps(openai_batch.output_line(job, jid, record.endpoint), ensure_ascii=False))
                f.write("\n")
                written += 1
    os.replace(tmp, out)
    log.info("batch_exported", batch_id=batch_id, lines=written, out=str(out))
    return written
