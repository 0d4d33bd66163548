"""What the dashboard's pages show, read from Redis with counts and paged reads only: no page ever scans all
jobs or all batches (a batch of 1M jobs costs one HGETALL; the batch list one ZREVRANGE of a page)."""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from typing import Any

from gateway.batches.records import GatewayBatch, batch_object, load_core
from gateway.context import GatewayContext
from protocol.models import JOB_ID_RE, Job
from protocol.records import BatchRecord, DeadLetter, QueueInfo

PAGE = 25
DEAD_PAYLOAD_CHARS = 8000  # a dead letter's request shown up to this (the rest is cut, with a note)
LINE_READ_CHARS = 64 * 1024  # an output/error file's line parsed for the page up to this (longer: its start shown)
CUSTOM_ID = re.compile(r'"custom_id": ?"([^"\\]{0,500})"')  # a long line's id, from the start it shows
DEAD_SCAN = 200  # a tenant's dead letters: entries read a call while looking for its own
DEAD_SCAN_LIMIT = 2000  # ... and at most this many a page, so a page costs the same whatever the stream holds


@dataclass
class BatchRow:
    obj: dict[str, Any]  # the OpenAI batch object, as GET /v1/batches/{id} answers
    done: int
    total: int
    percent: float
    rate: float | None  # requests ended per second since it started
    eta_s: float | None


def batch_row(gw: GatewayBatch, core: BatchRecord | None, now: float) -> BatchRow:
    obj = batch_object(gw, core)
    counts = obj["request_counts"]
    total = counts["total"]
    done = counts["completed"] + counts["failed"]
    started = obj["in_progress_at"]
    ended = obj["completed_at"] or obj["cancelled_at"] or obj["expired_at"] or obj["failed_at"]
    elapsed = ((ended or now) - started) if started else 0
    rate = done / elapsed if elapsed > 0 and done else None
    eta = (total - done) / rate if rate and not ended and total > done else None
    return BatchRow(obj, done, total, 100.0 * done / total if total else 0.0, rate, eta)


def batches_page(ctx: GatewayContext, owner: str, page: int) -> tuple[list[BatchRow], int]:
    """One page of this owner's batches, newest first, and how many it has in all."""
    key = ctx.gkeys.batches(owner)
    total = ctx.redis.zcard(key)
    ids = ctx.redis.zrevrange(key, page * PAGE, page * PAGE + PAGE - 1)
    pipe = ctx.redis.pipeline(transaction=False)
    for bid in ids:
        pipe.hgetall(ctx.gkeys.batch(bid)).hgetall(ctx.keys.batch(bid))
    raw = pipe.execute()
    now, rows = time.time(), []
    for gw_raw, core_raw in zip(raw[::2], raw[1::2], strict=True):
        gw = GatewayBatch.from_hash(gw_raw)
        if gw is not None:  # deleted between the two reads
            rows.append(batch_row(gw, BatchRecord.from_record(core_raw) if core_raw else None, now))
    return rows, total


def owned_batch(ctx: GatewayContext, owner: str, batch_id: str) -> BatchRow | None:
    gw = GatewayBatch.load(ctx.redis, ctx.gkeys, batch_id)
    if gw is None or gw.owner != owner:
        return None
    return batch_row(gw, load_core(ctx.redis, ctx.keys, batch_id), time.time())


def batch_jobs(ctx: GatewayContext, batch_id: str, page: int) -> tuple[list[Job], int]:
    """One page of a batch's jobs in input order (LRANGE of its job list: O(page), whatever its size)."""
    key = ctx.keys.batch_jobs(batch_id)
    total = ctx.redis.llen(key)
    ids = ctx.redis.lrange(key, page * PAGE, page * PAGE + PAGE - 1)
    return [j for j in ctx.client.get_many(ids) if j is not None], total


def file_lines(ctx: GatewayContext, owner: str, file_id: str | None, limit: int = PAGE) -> list[dict[str, Any]]:
    """The first lines of an output or error file (each parsed; a file is read only that far)."""
    if not file_id or ctx.files.find(owner, file_id) is None:
        return []
    out: list[dict[str, Any]] = []
    path = ctx.files.path(file_id)
    if not path.is_file():
        return []
    with path.open(encoding="utf-8", errors="replace") as f:
        while len(out) < limit and (line := f.readline(LINE_READ_CHARS)):
            if not line.endswith("\n") and len(line) == LINE_READ_CHARS:
                while (rest := f.readline(LINE_READ_CHARS)) and not rest.endswith("\n"):
                    pass  # the rest of a long line: read through, never held (the page shows its start only)
                cid = CUSTOM_ID.search(line)
                out.append({"custom_id": cid and cid.group(1),
                            "error": {"message": f"(a line longer than {LINE_READ_CHARS:,} characters: download the "
                                                 f"file) {line}"}})
                continue
            try:
                out.append(json.loads(line))
            except ValueError:
                out.append({"custom_id": None, "error": {"message": line}})
    return out


@dataclass
class DeadLetterCard:
    """A dead letter as its page shows it: the entry (protocol.records.DeadLetter) and its request pretty-printed."""

    id: str  # the entry's id in {ns}:dead
    letter: DeadLetter
    request: str  # pretty JSON when it parses, else the raw text (cut at DEAD_PAYLOAD_CHARS)
    cut: bool = False


def _dead(entry_id: str, fields: dict[str, str]) -> DeadLetterCard:
    letter = DeadLetter.from_fields(fields)
    try:
        text = json.dumps(json.loads(letter.request), indent=2, ensure_ascii=False)
    except (ValueError, RecursionError):
        text = letter.request
    return DeadLetterCard(entry_id, letter, text[:DEAD_PAYLOAD_CHARS], len(text) > DEAD_PAYLOAD_CHARS)


def dead_owners(ctx: GatewayContext, job_ids: list[str]) -> list[str | None]:
    """The key that made each dead letter's job, as the gateway stamped it, or None (not the gateway's job).

    A completion's (and a retried dead letter's) owner is its `{ns}:gw:job:{id}` record; a batch job's, its
    batch's `{ns}:gw:batch:{id}`, found from the job record's batch_id or, with the record gone, from the id
    itself (`{batch_id}-{index}`, protocol.models.batch_job_id). Two pipelined reads for a whole page."""
    valid = [JOB_ID_RE.match(j) is not None for j in job_ids]
    pipe = ctx.redis.pipeline(transaction=False)
    for jid, ok in zip(job_ids, valid, strict=True):
        if ok:
            pipe.hget(ctx.gkeys.job(jid), "owner").hget(ctx.keys.job(jid), "batch_id")
    raw = iter(pipe.execute())
    owners: list[str | None] = []
    batch_of: dict[int, str] = {}
    for i, (jid, ok) in enumerate(zip(job_ids, valid, strict=True)):
        owner, batch_id = (next(raw), next(raw)) if ok else (None, None)
        owners.append(owner)
        if ok and owner is None:
            head, _, index = jid.rpartition("-")
            if batch_id or (head and index.isdigit()):
                batch_of[i] = batch_id or head
    if batch_of:
        pipe = ctx.redis.pipeline(transaction=False)
        for bid in batch_of.values():
            pipe.hget(ctx.gkeys.batch(bid), "owner")
        for i, owner in zip(batch_of, pipe.execute(), strict=True):
            owners[i] = owner
    return owners


def dead_letters(ctx: GatewayContext, before: str | None,
                 owner: str | None) -> tuple[list[DeadLetterCard], int | None, str | None]:
    """A page of dead letters, newest first (XREVRANGE from `before`, exclusive), the total, the next cursor.

    owner None (an operator): every entry, and the stream's length. Otherwise only that key's entries: read
    DEAD_SCAN at a time, at most DEAD_SCAN_LIMIT entries a page (then the cursor goes on from there), and no
    total (counting one key's would mean reading the whole stream)."""
    top = f"({before}" if before else "+"
    if owner is None:
        entries = ctx.redis.xrevrange(ctx.keys.dead, top, "-", count=PAGE + 1)
        rows = [_dead(i, f) for i, f in entries[:PAGE]]
        return rows, ctx.redis.xlen(ctx.keys.dead), rows[-1].id if len(entries) > PAGE else None
    rows, scanned, cursor = [], 0, None
    while len(rows) < PAGE and scanned < DEAD_SCAN_LIMIT:
        entries = ctx.redis.xrevrange(ctx.keys.dead, top, "-", count=DEAD_SCAN)
        if not entries:
            return rows, None, None
        for (entry_id, fields), who in zip(entries, dead_owners(ctx, [f.get("job_id", "") for _, f in entries]),
                                           strict=True):
            scanned, cursor = scanned + 1, entry_id
            if who == owner:
                rows.append(_dead(entry_id, fields))
                if len(rows) == PAGE:
                    break
        top = f"({cursor}"
    more = ctx.redis.xrevrange(ctx.keys.dead, top, "-", count=1)
    return rows, None, cursor if more else None


def dead_letter(ctx: GatewayContext, entry_id: str, owner: str | None) -> DeadLetterCard | None:
    """One dead letter, if `owner` made its job (owner None: an operator, any entry)."""
    entries = ctx.redis.xrange(ctx.keys.dead, entry_id, entry_id, count=1)
    if not entries:
        return None
    card = _dead(*entries[0])
    if owner is not None and dead_owners(ctx, [card.letter.job_id])[0] != owner:
        return None  # another key's entry reads as missing, as another key's job does
    return card


def workers(info: QueueInfo) -> list[dict[str, Any]]:
    """Each worker's heartbeat as the Workers page shows it (alive ones first)."""
    now, rows = time.time(), []
    for w in info.workers:
        hb = w.heartbeat
        used = hb.used_blocks if hb else None
        free = hb.free_blocks if hb else None
        rows.append({
            "name": w.name, "alive": w.alive, "hb": hb,
            "age_s": now - hb.last_seen if hb and hb.last_seen else None,
            "blocks_total": (used or 0) + (free or 0) if used is not None and free is not None else None,
            "hit_rate": hb.prefix_hit_rate if hb else None,
        })
    return sorted(rows, key=lambda r: (not r["alive"], r["name"]))


def models(info: QueueInfo, rates: dict[str, float]) -> list[dict[str, Any]]:
    """Each model as the overview shows it: queued (not picked up yet), running, live workers, jobs/s, and
    whether its jobs wait with no live worker."""
    running: dict[str, int] = {}
    for w in info.workers:
        if w.alive and w.heartbeat:
            for mid in w.heartbeat.served():
                running[mid] = running.get(mid, 0) + w.heartbeat.running
    return [{"id": m.id or "(default queues)", "default": m.default, "queued": max(0, m.queue_depth - m.pending),
             "running": running.get(m.id, 0), "workers": m.workers, "jobs_s": rates.get(m.id, 0.0),
             "unserved": m.unserved, "kinds": m.kinds} for m in info.models]


def valid_job_id(job_id: str) -> bool:
    return bool(JOB_ID_RE.match(job_id))
