"""Re-run what failed: a new batch of the lines of an ended batch that did not finish (failed, cancelled, or
never run because the batch expired), copied verbatim from its input file so they keep their custom_ids.

Job `{batch_id}-{i}` is the input file's i-th request line (blank lines skipped), so the lines to copy are known
from the job records alone, even from one whose record expired. `tokenbus batch retry ID` and the gateway's
POST /v1/batches/{id}/retry (gateway/batches/retry.py) both use this; the two batches name each other
(`retry_of` in the new one's record, `retried_by` in the old one's).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

from producer.batches import get_batch, iter_batch_job_ids, submit_batch
from producer.client_api import ClientApi
from protocol.errors import TokenbusError
from protocol.models import JobStatus
from protocol.records import BatchRecord


class NothingToRetry(TokenbusError):
    """The batch has not ended, or every one of its requests finished."""


def unfinished_lines(client: ClientApi, batch_id: str) -> set[int]:
    """The input line indexes (0-based, blank lines skipped) of the ended batch's requests that did not finish."""
    record = get_batch(client, batch_id)
    if not record.is_terminal:
        raise NothingToRetry(f"batch {batch_id} is {record.status.value}: retry it once it has ended")
    out: set[int] = set()
    at = 0
    for chunk in iter_batch_job_ids(client, batch_id):
        for i, job in enumerate(client.get_many(chunk)):
            if job is None or job.status != JobStatus.finished:
                out.add(at + i)
        at += len(chunk)
    if not out:
        raise NothingToRetry(f"every request of batch {batch_id} finished: there is nothing to retry")
    return out


def pick_lines(lines: Iterable[bytes], wanted: set[int]) -> Iterator[bytes]:
    """The request lines (non-blank, numbered from 0) whose index is in wanted, each ending in a newline."""
    index = 0
    for line in lines:
        if not line.strip():
            continue
        if index in wanted:
            yield line if line.endswith(b"\n") else line + b"\n"
        index += 1


def retry_batch(client: ClientApi, batch_id: str, input_file: str | Path | None = None,
                out: str | Path | None = None) -> BatchRecord:
    """Submit a new producer batch of the unfinished lines of `batch_id` (from its input file, or input_file
    when that has moved), with the same priority. The lines go to `out` first (default: beside the input,
    `<input>.retry-<batch id>.jsonl`), the new batch's input file, so a retry of the retry finds its lines.
    The two records are linked. Returns the new batch's record."""
    record = get_batch(client, batch_id)
    source = Path(input_file or record.input_file or "")
    if not source.is_file():
        raise TokenbusError(f"the input file of batch {batch_id} ({record.input_file or 'unknown'}) is not here; "
                            "pass it with --file")
    wanted = unfinished_lines(client, batch_id)
    target = Path(out) if out else source.with_name(f"{source.name}.retry-{batch_id}.jsonl")
    with source.open("rb") as src, target.open("wb") as dst:
        dst.writelines(pick_lines(src, wanted))
    new = submit_batch(client, target, priority=record.priority)
    pipe = client.redis.pipeline(transaction=True)
    pipe.hset(client.keys.batch(new.id), "retry_of", batch_id)
    pipe.hset(client.keys.batch(batch_id), "retried_by", new.id)
    pipe.execute()
    return get_batch(client, new.id)
