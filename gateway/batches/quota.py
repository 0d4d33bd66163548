"""Per-key quotas on queued batch work: a new batch is refused (429 quota_exceeded) when the key's unfinished
batches and it together would hold more requests or tokens than max_queued_requests_per_key /
max_queued_tokens_per_key. Interactive calls have their own per-key limits (live/quotas.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.errors import APIError
from protocol.models import TERMINAL_BATCH_STATUSES

if TYPE_CHECKING:
    from gateway.context import GatewayContext

RECENT_BATCHES = 1000  # a key's newest batches looked at for what it still has queued


def queued_by_batches(ctx: GatewayContext, owner: str) -> tuple[int, int]:
    """(requests, tokens) a key's unfinished batches (its newest RECENT_BATCHES) still have to run: each
    batch's total less what ended, and its token estimate in proportion."""
    ids = ctx.redis.zrevrange(ctx.gkeys.batches(owner), 0, RECENT_BATCHES - 1)
    pipe = ctx.redis.pipeline(transaction=False)
    for bid in ids:
        pipe.hmget(ctx.gkeys.batch(bid), "final_status", "total", "tokens")
        pipe.hmget(ctx.keys.batch(bid), "status", "finished", "failed", "cancelled")
    replies = pipe.execute()
    requests = tokens = 0
    for i in range(len(ids)):
        (final, total, est), (status, *ended) = replies[2 * i], replies[2 * i + 1]
        if final or status in TERMINAL_BATCH_STATUSES or not total:
            continue
        left = max(0, int(total) - sum(int(x or 0) for x in ended))
        requests += left
        tokens += int(est or 0) * left // int(total)
    return requests, tokens


def check_batch_quota(ctx: GatewayContext, owner: str, requests: int, tokens: int) -> None:
    """429 when a new batch would take the key past max_queued_requests_per_key or max_queued_tokens_per_key."""
    s = ctx.settings
    queued, queued_tokens = queued_by_batches(ctx, owner)
    why = None
    if queued + requests > s.max_queued_requests_per_key:
        why = (f"this key's batches have {queued} requests queued; {requests} more would pass the limit "
               f"max_queued_requests_per_key = {s.max_queued_requests_per_key}")
    elif queued_tokens + tokens > s.max_queued_tokens_per_key:
        why = (f"this key's batches have about {queued_tokens} tokens queued; this batch's {tokens} would "
               f"pass the limit max_queued_tokens_per_key = {s.max_queued_tokens_per_key}")
    if why:
        raise APIError(429, f"too much queued for this API key: {why}; wait for your batches to finish or "
                            "submit a smaller one", code="quota_exceeded", headers={"retry-after": "60"})
