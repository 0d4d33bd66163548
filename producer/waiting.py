"""Waiting on jobs: each job yielded once it has ended (as_completed), and a streaming job's output as its
worker publishes it (stream). Client.wait / as_completed / stream call these (producer/client.py)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from producer.client_api import ClientApi
from protocol.errors import JobNotFound, WaitTimeout
from protocol.models import TERMINAL_STATUSES, Job


@dataclass
class TokenChunk:
    """Part of a streaming job's output: `token_ids` starting at output position `offset`."""

    offset: int
    token_ids: list[int]
    text: str
    done: bool


def not_found(client: ClientApi, job_id: str) -> str:
    return (f"job {job_id!r} not found in namespace {client.keys.ns!r}: it was never submitted, "
            f"or it ended more than result_ttl seconds ago and its record expired")


def as_completed(client: ClientApi, job_ids: Iterable[str], timeout: float | None = None,
                 resync_every: float = 5.0) -> Iterator[Job]:
    """Yield each job once it has ended, in the order they end (already-ended ones first).

    Blocks on XREAD of `{ns}:events`, not by polling records, so each job costs O(1) however many wait.
    Every `resync_every` seconds it checks whether events it has not read were trimmed (the stream's
    oldest entry is past its position, or the stream is gone) and only then re-reads the statuses.
    """
    remaining = dict.fromkeys(job_ids)
    deadline = None if timeout is None else time.monotonic() + timeout
    # The position before reading statuses: an end between the two is then seen as an event.
    last_id = client.events_last_id()
    yield from _collect_ended(client, remaining, list(remaining), initial=True)
    next_resync = time.monotonic() + resync_every
    while remaining:
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            raise WaitTimeout(
                f"{len(remaining)} job(s) had not ended after {timeout} s "
                f"(first: {next(iter(remaining))!r})", pending=list(remaining))
        wait_s = min(next_resync - now, client.max_block_s,
                     (deadline - now) if deadline is not None else resync_every)
        resp = client.redis.xread({client.keys.events: last_id}, count=1000, block=max(1, int(wait_s * 1000)))
        ended = []
        for _stream, entries in resp or []:
            for entry_id, fields in entries:
                last_id = entry_id
                if fields.get("job_id") in remaining:
                    ended.append(fields["job_id"])
        if time.monotonic() >= next_resync:
            if _events_lost(client, last_id):
                ended = list(remaining)
            next_resync = time.monotonic() + resync_every
        yield from _collect_ended(client, remaining, list(dict.fromkeys(ended)))


def _collect_ended(client: ClientApi, remaining: dict[str, None], candidates: list[str],
                   initial: bool = False) -> Iterator[Job]:
    # only ended jobs are yielded: the others' requests (one XRANGE each) would be read for nothing
    for jid, job in zip(candidates, client.get_many(candidates, ended_requests_only=True), strict=True):
        if job is None:
            if initial:
                raise JobNotFound(not_found(client, jid))
            raise JobNotFound(f"job {jid!r} ended but its record expired before it was read "
                              f"(result_ttl {client.result_ttl} s is too short for this reader)")
        if job.status in TERMINAL_STATUSES and jid in remaining:
            del remaining[jid]
            yield job


def _events_lost(client: ClientApi, last_id: str) -> bool:
    """Whether events after `last_id` may be gone unread: the stream is missing (deleted, or nothing ended
    yet) or its oldest entry is newer than the next one this reader would read (MAXLEN trimmed past it)."""
    oldest = client.redis.xrange(client.keys.events, count=1)
    if not oldest:
        return True
    return _stream_id(oldest[0][0]) > _stream_id(last_id)


def _stream_id(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def stream(client: ClientApi, job_id: str, timeout: float | None = None) -> Iterator[TokenChunk]:
    """Yield a `stream=True` job's output as the worker publishes it; ends with the chunk marked done.

    Each chunk holds the new token ids and the text they complete. A chunk re-sent after a Redis outage
    is skipped by its offset. A job that asked for a stream ends on a done chunk however it ends (an empty
    one when it failed before it ran or was cancelled while queued: docs/protocol.md, "How a token stream
    ends"); one that did not ask just ends the iteration once it has ended. Read the record with `get` for
    its status. A record that is gone (expired, deleted) raises JobNotFound.
    """
    key = client.keys.tokens(job_id)
    last_id, next_offset = "0-0", 0
    deadline = None if timeout is None else time.monotonic() + timeout
    job_ended = False
    while True:
        if deadline is not None and time.monotonic() >= deadline:
            raise WaitTimeout(f"job {job_id!r} streamed nothing new for {timeout} s", pending=[job_id])
        block = None if job_ended else max(1, int(client.max_block_s * 1000))
        resp = client.redis.xread({key: last_id}, count=100, block=block)
        entries = [e for _stream, batch in resp or [] for e in batch]
        for entry_id, fields in entries:
            last_id = entry_id
            offset, token_ids = int(fields["offset"]), json.loads(fields["token_ids"])
            if offset + len(token_ids) <= next_offset and token_ids:
                continue
            next_offset = offset + len(token_ids)
            done = fields.get("done") == "1"
            yield TokenChunk(offset=offset, token_ids=token_ids, text=fields.get("text", ""), done=done)
            if done:
                return
        if not entries:
            if job_ended:  # ended, and the stream read once more after that: nothing else will come
                return
            job_ended = client.get(job_id).status in TERMINAL_STATUSES
