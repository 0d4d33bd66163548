"""How long an ended batch is kept (batch_retention_s, 30 days by default), as OpenAI's batches stay retrievable
for a long while and then go.

An ended batch's record (its errors included) is counted against its key's byte limits until it goes: in the
key's ledger's hour its retention ends in (RELEASE_BYTES, capacity.release), not as `held` for good, which let
a key running ~1,000 batches a day reach its byte limit for good (issue #34 follow-up). The record is listed in
{ns}:gw:ended-batches by when it is due; the watcher's full scan deletes those due with their entries in the
key's list and gives their count back (FORGET_BATCH), and the record expires by itself at the end of the hour it
is counted in, should no watcher run. Its output and error files go with it unless output_expires_after says
otherwise (finalise.py). A retention of 0 keeps records for good, counted as `held`; records ended while it
was 0 stay so.
"""

from __future__ import annotations

import time

import structlog

from gateway.context import GatewayContext
from protocol.scripts import lua, script

log = structlog.get_logger("tokenbus.gateway")

SWEEP_BATCH = 1000  # records forgotten a scan at most: the rest wait for the next one
_FORGET = lua("forget_batch")  # protocol/lua/forget_batch.lua


def files_expire_at(ctx: GatewayContext, now: float, output_expires_s: int | None) -> float | None:
    """When an ended batch's output and error files go: output_expires_after if it asked, else with its record
    (batch_retention_s; None: kept until deleted)."""
    if output_expires_s is not None:
        return now + output_expires_s
    keep = ctx.settings.batch_retention_s
    return now + keep if keep > 0 else None


def forget(ctx: GatewayContext, owner: str, batch_id: str) -> int:
    """Delete one ended batch's record and its entries, giving its count back (FORGET_BATCH); the bytes."""
    g = ctx.gkeys
    return int(script(_FORGET)(keys=[g.batch(batch_id), g.batches(owner), g.ended_batches, g.kept_bytes(owner),
                                     g.kept_bytes("*")], args=[batch_id, f"{owner}:{batch_id}"], client=ctx.redis))


def sweep(ctx: GatewayContext, now: float | None = None) -> int:
    """Forget the ended batches whose retention has passed (the watcher calls this); returns how many."""
    due = ctx.redis.zrangebyscore(ctx.gkeys.ended_batches, "-inf", now or time.time(), start=0, num=SWEEP_BATCH)
    for member in due:
        owner, _, batch_id = member.partition(":")
        forget(ctx, owner, batch_id)
    if due:
        log.info("gateway_batches_forgotten", count=len(due), retention_s=ctx.settings.batch_retention_s)
    return len(due)
