"""Redis capacity: what a batch will cost in Redis bytes, checked and reserved before any job is written.

A queued job holds its request once (its stream entry; the job record holds short fields only) plus fixed
overhead (hash and stream bookkeeping, ids, timestamps). JOB_OVERHEAD_BYTES and BODY_FACTOR are measured by
benchmarks/queue/redis_bytes.py (docs/gateway-redis-bytes.md); the estimate rounds both up.

Checked at POST /v1/batches, in order: Redis keeps redis_reserve_bytes of its maxmemory free after the batch
(INFO memory); the key's open batches stay under max_queued_bytes_per_key; all keys' under max_queued_bytes.
The reservation ({ns}:gw:queued-bytes: owner -> bytes, "*" -> all) is returned once when the batch ends.
The three limits can be changed without a restart: HSET {ns}:gw:config max_queued_bytes_per_key N (also
max_queued_bytes, redis_reserve_bytes); HDEL goes back to the setting.
"""

from __future__ import annotations

import time

from gateway.context import GatewayContext
from gateway.errors import APIError
from protocol.connection import on_shard
from protocol.scripts import lua, script

JOB_OVERHEAD_BYTES = 500  # measured: 401 per job (fit over lines of 235-3,195 bytes, gateway-long ids), rounded up
BODY_FACTOR = 1.25  # measured: 1.14 x the input line's bytes (the request JSON once, as stored), rounded up

_RESERVE = lua("reserve_bytes")  # protocol/lua/reserve_bytes.lua
_RELEASE = lua("release_bytes")  # protocol/lua/release_bytes.lua


def estimate(requests: int, file_bytes: int) -> int:
    """Redis bytes a batch of `requests` lines totalling `file_bytes` takes while queued."""
    return int(requests * JOB_OVERHEAD_BYTES + file_bytes * BODY_FACTOR)


def _refuse(message: str, code: str) -> APIError:
    return APIError(429, message, code=code, headers={"retry-after": "60"})


def reserve(ctx: GatewayContext, owner: str, need: int) -> None:
    """Reserve `need` bytes for one batch of `owner`, or raise 429 naming the limit."""
    per_key, total, reserve_free = limits(ctx)
    mem = ctx.redis.info("memory", **on_shard(ctx.redis, ctx.keys.routing_key))  # the namespace's shard
    maxmemory, used = int(mem.get("maxmemory", 0)), int(mem.get("used_memory", 0))
    if maxmemory and used + need + reserve_free > maxmemory:
        raise _refuse(f"Redis has no room for this batch now: it needs about {need} bytes, Redis uses {used} of "
                      f"its maxmemory {maxmemory} and keeps {reserve_free} free for the queue; retry "
                      "when running batches have ended, or split the file", "redis_capacity")
    code, value = script(_RESERVE)(keys=[ctx.gkeys.queued_bytes], args=[owner, need, per_key, total],
                                   client=ctx.redis)
    if int(code) == -1:
        raise _refuse(f"this API key's open batches already hold about {value} bytes in Redis; with this one "
                      f"(about {need}) they would pass max_queued_bytes_per_key {per_key}. "
                      "Wait for a batch to end, or split the file", "queued_bytes_per_key_exceeded")
    if int(code) == -2:
        raise _refuse(f"the gateway's open batches already hold about {value} bytes in Redis; with this one "
                      f"(about {need}) they would pass max_queued_bytes {total}. Retry later",
                      "queued_bytes_exceeded")


def limits(ctx: GatewayContext) -> tuple[int, int, int]:
    """(max_queued_bytes_per_key, max_queued_bytes, redis_reserve_bytes): {ns}:gw:config, else the settings."""
    s = ctx.settings
    raw = ctx.redis.hmget(ctx.gkeys.config, "max_queued_bytes_per_key", "max_queued_bytes", "redis_reserve_bytes")
    defaults = (s.max_queued_bytes_per_key, s.max_queued_bytes, s.redis_reserve_bytes)
    return tuple(int(v) if v not in (None, "") else d for v, d in zip(raw, defaults, strict=True))  # type: ignore


def release(ctx: GatewayContext, batch_id: str, owner: str) -> int:
    """Give back a batch's reservation (once; later calls return 0)."""
    return int(script(_RELEASE)(keys=[ctx.gkeys.batch(batch_id), ctx.gkeys.queued_bytes],
                                args=[owner, time.time()], client=ctx.redis))


def held(ctx: GatewayContext, owner: str | None = None) -> int:
    return int(ctx.redis.hget(ctx.gkeys.queued_bytes, owner or "*") or 0)
