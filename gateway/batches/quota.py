"""Per-key quotas on queued batch work: a new batch is refused (429 quota_exceeded) when the key's unfinished
batches and it together would hold more requests or tokens than max_queued_requests_per_key /
max_queued_tokens_per_key. Counted and checked with the batch's written record in one script
(protocol/lua/admit_batch.lua, run by capacity.admit), so simultaneous creates cannot all pass one check.
Interactive calls have their own per-key limits (live/quotas.py)."""

from __future__ import annotations

from gateway.errors import APIError
from gateway.settings import GatewaySettings

RECENT_BATCHES = 1000  # a key's newest batches looked at for what it still has queued


def quota_refusal(settings: GatewaySettings, tokens_limit: bool, queued: int, requests: int,
                  tokens: int) -> APIError:
    """The 429 of a batch past the key's requests (or, tokens_limit, tokens) quota; `queued` is what the
    key's batches hold of that."""
    if tokens_limit:
        why = (f"this key's batches have about {queued} tokens queued; this batch's {tokens} would "
               f"pass the limit max_queued_tokens_per_key = {settings.max_queued_tokens_per_key}")
    else:
        why = (f"this key's batches have {queued} requests queued; {requests} more would pass the limit "
               f"max_queued_requests_per_key = {settings.max_queued_requests_per_key}")
    return APIError(429, f"too much queued for this API key: {why}; wait for your batches to finish or "
                         "submit a smaller one", code="quota_exceeded", headers={"retry-after": "60"})
