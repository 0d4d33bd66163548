"""Redis capacity: what a batch will cost in Redis bytes, checked and reserved before any job is written.

A queued job holds its request once (its stream entry; the job record holds short fields only) plus fixed
overhead (hash and stream bookkeeping, ids, timestamps). JOB_OVERHEAD_BYTES and BODY_FACTOR are measured by
benchmarks/queue/redis_bytes.py (docs/gateway-redis-bytes.md); the estimate rounds both up.

Checked at POST /v1/batches, in order: Redis keeps redis_reserve_bytes of its maxmemory free after the batch
(INFO memory); the key's open batches and results kept (gateway/kept_bytes.py) stay under
max_queued_bytes_per_key; all keys' under max_queued_bytes. The reservation ({ns}:gw:queued-bytes: owner ->
bytes, "*" -> all) is returned once when the batch ends, and what its results keep moves to the key's ledger
until they expire, its own record (its errors) until it goes (batch_retention_s, retention.py). The same
limits count a key's files' metadata (files/store.py) and dashboard sessions (ui/session.py). Left unset, the
limits are sized to Redis's maxmemory at start (derive_limits).
The three limits can be changed without a restart: HSET {ns}:gw:config max_queued_bytes_per_key N (also
max_queued_bytes, redis_reserve_bytes); HDEL goes back to the setting.
"""

from __future__ import annotations

import math
import time

import redis
import structlog

from gateway.batches.quota import RECENT_BATCHES, quota_refusal
from gateway.batches.records import GatewayBatch
from gateway.byte_limits import INDEX_ENTRY_BYTES, raise_for, refuse
from gateway.context import GatewayContext
from gateway.errors import APIError
from protocol.connection import on_shard
from protocol.models import DEFAULT_RESULT_TTL, TERMINAL_BATCH_STATUSES
from protocol.scripts import lua, script

log = structlog.get_logger("tokenbus.gateway")

JOB_OVERHEAD_BYTES = 500  # measured: 401 per job (fit over lines of 235-3,195 bytes, gateway-long ids), rounded up
BODY_FACTOR = 1.25  # measured: 1.14 x the input line's bytes (the request JSON once, as stored), rounded up
RECORD_OVERHEAD_BYTES = 200  # allowance for a gateway batch record's hash beyond its fields' bytes
LEDGER_HOUR_S = 3600  # a ledger of results kept counts them by the hour they expire in: at most 24 x 8 fields
KEY_SHARE = 4  # a derived per-key byte limit is this fraction of everyone's (derive_limits): 4 keys at it fill Redis

_RESERVE = lua("reserve_bytes")  # protocol/lua/reserve_bytes.lua
_ADMIT = lua("admit_batch")  # protocol/lua/admit_batch.lua: the quotas, the bytes and the record in one step
_RELEASE = lua("release_bytes")  # protocol/lua/release_bytes.lua


def estimate(requests: int, file_bytes: int, result_bytes: int = 0) -> int:
    """Redis bytes a batch of `requests` lines totalling `file_bytes` takes while open: its queued requests, and
    the `result_bytes` its results may hold (producer.batch_file.result_bytes: logprobs included)."""
    return int(requests * JOB_OVERHEAD_BYTES + file_bytes * BODY_FACTOR) + result_bytes


def reserve_problem(maxmemory: int, reserve_free: int) -> str | None:
    """Why no batch can ever be admitted with this maxmemory (0 = none) and redis_reserve_bytes, or None."""
    if not maxmemory or reserve_free < maxmemory:
        return None
    return (f"Redis's maxmemory ({maxmemory} bytes) is not above the gateway's redis_reserve_bytes "
            f"({reserve_free}), so every batch would be refused however empty Redis is. Raise Redis's maxmemory, "
            "or set redis_reserve_bytes below it (TOKENBUS_GATEWAY_REDIS_RESERVE_BYTES, or HSET {ns}:gw:config "
            f"redis_reserve_bytes N; e.g. {maxmemory // 8})")


def check_at_start(ctx: GatewayContext) -> None:
    """ValueError when Redis's maxmemory leaves no room for any batch (reserve_problem); the byte limits left at
    their defaults sized to Redis (derive_limits); a warning when the limits would let Redis fill up before
    them. A Redis that does not answer yet is left to /healthz."""
    try:
        maxmemory = _memory(ctx)[0]
        reserve_free = limits(ctx)[2]
        if problem := reserve_problem(maxmemory, reserve_free):
            raise ValueError(problem)
        derive_limits(ctx, maxmemory, reserve_free)
        per_key, total, reserve_free = limits(ctx)
    except redis.RedisError:
        return
    room = maxmemory - reserve_free
    if maxmemory and (not total or total > room or not per_key or per_key > room):
        # Completions are held to the byte limits alone (the reserve is kept for them): limits above what
        # Redis can hold let one key's results fill it, as 27 calls filled a 25 MB Redis (issue #34).
        log.warning("gateway_byte_limits_above_redis", maxmemory=maxmemory, redis_reserve_bytes=reserve_free,
                    max_queued_bytes=total, max_queued_bytes_per_key=per_key,
                    fix=f"set TOKENBUS_GATEWAY_MAX_QUEUED_BYTES to at most {room} (maxmemory less the reserve) "
                        "and MAX_QUEUED_BYTES_PER_KEY to one key's share of it")


def derive_limits(ctx: GatewayContext, maxmemory: int, reserve_free: int) -> None:
    """With a Redis maxmemory, the byte limits left at their defaults (no TOKENBUS_GATEWAY_MAX_QUEUED_BYTES[_PER_KEY])
    become Redis's size: everyone's = maxmemory less redis_reserve_bytes, one key's = 1/KEY_SHARE of everyone's
    (the fixed defaults, 4 GiB and 512 MiB, let a Redis smaller than them fill before any limit). Set ones win,
    and so do {ns}:gw:config's at run time. Logged, with what they became."""
    s, room = ctx.settings, maxmemory - reserve_free
    if not maxmemory or room <= 0:
        return
    derived: dict[str, int] = {}
    if "max_queued_bytes" not in s.model_fields_set:
        derived["max_queued_bytes"] = room
    if "max_queued_bytes_per_key" not in s.model_fields_set:
        total = derived.get("max_queued_bytes", s.max_queued_bytes)
        derived["max_queued_bytes_per_key"] = min(total or room, room) // KEY_SHARE
    for name, value in derived.items():
        setattr(s, name, value)
    if derived:
        log.info("gateway_byte_limits_from_maxmemory", maxmemory=maxmemory, redis_reserve_bytes=reserve_free,
                 key_share=KEY_SHARE, **derived,
                 fix="set TOKENBUS_GATEWAY_MAX_QUEUED_BYTES / _PER_KEY to choose them yourself")


def _memory(ctx: GatewayContext) -> tuple[int, int]:
    """(maxmemory, used_memory) of the namespace's shard."""
    mem = ctx.redis.info("memory", **on_shard(ctx.redis, ctx.keys.routing_key))
    return int(mem.get("maxmemory", 0)), int(mem.get("used_memory", 0))


def _check_memory(ctx: GatewayContext, need: int, reserve_free: int) -> None:
    """503 when no batch can ever fit (reserve_problem); 429 when Redis has no room for `need` bytes now."""
    maxmemory, used = _memory(ctx)
    if problem := reserve_problem(maxmemory, reserve_free):
        raise APIError(503, f"this gateway cannot queue batches: {problem}", code="redis_reserve_too_large")
    if maxmemory and used + need + reserve_free > maxmemory:
        raise refuse(f"Redis has no room for this batch now: it needs about {need} bytes, Redis uses {used} of "
                      f"its maxmemory {maxmemory} and keeps {reserve_free} free for the queue; retry "
                      "when running batches have ended, or split the file", "redis_capacity")


def reserve(ctx: GatewayContext, owner: str, need: int) -> None:
    """Reserve `need` bytes for `owner`, or raise 429 naming the limit (admit does it for a new batch)."""
    per_key, total, reserve_free = limits(ctx)
    _check_memory(ctx, need, reserve_free)
    code, value = script(_RESERVE)(keys=[ctx.gkeys.queued_bytes, *ledgers(ctx, owner)],
                                   args=[owner, need, per_key, total, time.time()], client=ctx.redis)
    raise_for(int(code), int(value), need, per_key, total)


def admit(ctx: GatewayContext, gw: GatewayBatch, requests: int, tokens: int, queued_bytes: int) -> None:
    """Admit and write a new batch in one step: the key's quotas on queued requests and tokens (quota.py),
    its bytes (`queued_bytes` for its jobs, plus its own record) against the byte limits, then its record, its
    place in the key's list and in `validating`, and the link from the batch it retries (gw.retry_of) unless
    that one has gone. Raises 429 (503) naming the limit; nothing is written then."""
    per_key, total, reserve_free = limits(ctx)
    gw.reserved_bytes = 0  # a field of the record it measures
    record_bytes = sum(len(k) + len(str(v).encode()) for k, v in gw.fields().items()) + RECORD_OVERHEAD_BYTES
    need = gw.reserved_bytes = queued_bytes + record_bytes  # the record counts too (its errors once held 24 MB)
    _check_memory(ctx, need, reserve_free)
    s = ctx.settings
    pairs = [x for kv in gw.fields().items() for x in kv]
    code, value = script(_ADMIT)(
        keys=[ctx.gkeys.queued_bytes, ctx.gkeys.batch(gw.id), ctx.gkeys.batches(gw.owner), ctx.gkeys.validating,
              *ledgers(ctx, gw.owner), ctx.gkeys.batch(gw.retry_of or gw.id)],
        args=[gw.owner, need, per_key, total, requests, tokens, s.max_queued_requests_per_key,
              s.max_queued_tokens_per_key, ctx.gkeys.batch(""), ctx.keys.batch(""), RECENT_BATCHES, gw.created_at,
              gw.id, ",".join(str(x.value) for x in TERMINAL_BATCH_STATUSES), gw.retry_of or "", *pairs],
        client=ctx.redis)
    code, value = int(code), int(value)
    if code in (-3, -4):
        raise quota_refusal(s, code == -4, value, requests, tokens)
    raise_for(code, value, need, per_key, total)


def until(ctx: GatewayContext, now: float, slack_s: float = 0) -> int:
    """The end of the hour by which records written now (kept result_ttl, plus `slack_s`) have expired: a
    ledger counts them until then (an hour late at most, never early). A result_ttl of 0 (kept for good) is
    counted for the default 7 days."""
    keep = ctx.client.result_ttl if ctx.client.result_ttl > 0 else DEFAULT_RESULT_TTL
    return until_s(now, keep + slack_s)


def until_s(now: float, keep_s: float) -> int:
    """The end of the hour by which a record written now and kept `keep_s` has expired (a ledger's field)."""
    return math.ceil((now + keep_s) / LEDGER_HOUR_S) * LEDGER_HOUR_S


def ledgers(ctx: GatewayContext, owner: str) -> list[str]:
    """The owner's ledger of results kept and everyone's (kept_bytes.py), as the byte scripts take them."""
    return [ctx.gkeys.kept_bytes(owner), ctx.gkeys.kept_bytes("*")]


def limits(ctx: GatewayContext) -> tuple[int, int, int]:
    """(max_queued_bytes_per_key, max_queued_bytes, redis_reserve_bytes): {ns}:gw:config, else the settings."""
    s = ctx.settings
    raw = ctx.redis.hmget(ctx.gkeys.config, "max_queued_bytes_per_key", "max_queued_bytes", "redis_reserve_bytes")
    defaults = (s.max_queued_bytes_per_key, s.max_queued_bytes, s.redis_reserve_bytes)
    return tuple(int(v) if v not in (None, "") else d for v, d in zip(raw, defaults, strict=True))  # type: ignore


def release(ctx: GatewayContext, batch_id: str, owner: str, kept: int = 0) -> int:
    """Give back a batch's reservation (once; later calls return 0), count the `kept` bytes its job records hold
    after it in the owner's ledger until they expire (until), and its own record until it goes: the hour its
    batch_retention_s ends in (the record expires then at the latest, retention.py), or held for good (0)."""
    now, keep_s = time.time(), ctx.settings.batch_retention_s
    return int(script(_RELEASE)(
        keys=[ctx.gkeys.batch(batch_id), ctx.gkeys.queued_bytes, *ledgers(ctx, owner), ctx.gkeys.ended_batches],
        args=[owner, now, kept, until(ctx, now), INDEX_ENTRY_BYTES, batch_id, keep_s, until_s(now, keep_s)],
        client=ctx.redis))


def held(ctx: GatewayContext, owner: str | None = None) -> int:
    """The owner's (None: everyone's) open reservations, without its ledger of results kept."""
    return int(ctx.redis.hget(ctx.gkeys.queued_bytes, owner or "*") or 0)
