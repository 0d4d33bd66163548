"""What an interactive completion keeps in Redis, counted against its key (issue #34: `top_logprobs` 20 kept ~854
bytes a token for 7 days, counted nowhere, until 27 calls filled a 25 MB Redis for everyone).

A call keeps its job record (its request, and its result with logprobs), its token stream when streamed, and
its ownership record, for result_ttl. Before its job is queued, the most those can hold is checked against the
key's max_queued_bytes_per_key and everyone's max_queued_bytes (the limits open batches count against,
batches/capacity.py) and kept in the key's ledger until the records expire: ADMIT_JOB, which also writes the
ownership record, so it is still the call's one round trip before the submit. Past a limit: 429
`stored_bytes_per_key_exceeded` / `stored_bytes_exceeded`, nothing queued. Once the job has ended, its entry
becomes what its records really hold, by Redis's own count (SETTLE_JOB, MEMORY USAGE: one round trip more a
call, after the worker is done); a call whose answer nobody waited for (a timeout, a client gone) keeps its
most counted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis
import structlog

from gateway.batches import capacity
from gateway.byte_limits import STORED_CODES, raise_for
from gateway.context import GatewayContext
from gateway.jobs import OWNERSHIP_SLACK_S
from producer.batch_file import result_bytes
from protocol.models import Job, JobRequest
from protocol.scripts import lua, script

log = structlog.get_logger("tokenbus.gateway")

STREAM_TOKEN_BYTES = 64  # one entry of a job's token stream (offset, token ids, text, done): 48 measured
OWNERSHIP_BYTES = 200  # the call's {ns}:gw:job:{id} hash (owner, endpoint, created_at, its ledger entry)

_ADMIT = lua("admit_job")  # protocol/lua/admit_job.lua
_SETTLE = lua("settle_job")  # protocol/lua/settle_job.lua


@dataclass(frozen=True)
class KeptCall:
    """A call's ledger entry: the most bytes it was admitted with, until SETTLE_JOB counts what it holds."""

    job_id: str
    owner: str
    most: int


def admit(ctx: GatewayContext, job_id: str, who: str, endpoint: str, request: JobRequest) -> KeptCall:
    """Reserve the call's most bytes and write its ownership record (before its job is queued, so a poll right
    after the submit finds it), in one step; 429 past a byte limit."""
    streamed = request.max_tokens * STREAM_TOKEN_BYTES if request.stream else 0  # only choice 0 streams
    most = capacity.estimate(1, len(request.model_dump_json().encode()), result_bytes(request) + streamed)
    kept = KeptCall(job_id, who, most + OWNERSHIP_BYTES)
    now = time.time()
    s = ctx.settings
    fields = {"owner": who, "endpoint": endpoint, "created_at": now}
    code, value, per_key, total = script(_ADMIT)(
        keys=[ctx.gkeys.queued_bytes, *capacity.ledgers(ctx, who), ctx.gkeys.job(job_id), ctx.gkeys.config],
        args=[who, kept.most, s.max_queued_bytes_per_key, s.max_queued_bytes, now,
              capacity.until(ctx, now, OWNERSHIP_SLACK_S), ctx.client.result_ttl + OWNERSHIP_SLACK_S,
              *[x for kv in fields.items() for x in kv]],
        client=ctx.redis)
    raise_for(int(code), int(value), kept.most, int(per_key), int(total), "call", STORED_CODES)
    return kept


def settle(ctx: GatewayContext, kept: KeptCall | None, job: Job | None) -> None:
    """Count what an ended call's records hold instead of its most (nothing while it has not ended)."""
    if kept is not None and job is not None and job.done:
        measure(ctx, kept)


def measure(ctx: GatewayContext, kept: KeptCall) -> None:
    """Count what the call's records hold now, once: its job has ended, or was never queued (the submit failed).
    A failure leaves the most counted (logged)."""
    try:
        script(_SETTLE)(keys=[ctx.gkeys.job(kept.job_id), *capacity.ledgers(ctx, kept.owner),
                              ctx.keys.job(kept.job_id), ctx.keys.tokens(kept.job_id)], client=ctx.redis)
    except redis.RedisError as err:
        log.warning("gateway_kept_bytes_not_settled", job_id=kept.job_id, error=str(err))
