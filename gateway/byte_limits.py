"""The byte limits' shared parts, below the gateway's context so that every store that keeps bytes in Redis
(batches/capacity.py, files/store.py, ui/session.py, kept_bytes.py) can refuse with one wording: the 429 naming
the limit, and what an index entry costs."""

from __future__ import annotations

from gateway.errors import APIError

# a member of a sorted set of ids (a key's batches, files, sessions) as Redis keeps it past 128 members (a
# skiplist): 123 bytes measured for a 30-character id, 171 for a 64-character hash; rounded up
INDEX_ENTRY_BYTES = 192
STORED_CODES = ("stored_bytes_per_key_exceeded", "stored_bytes_exceeded")  # what a call, upload or login keeps


def refuse(message: str, code: str) -> APIError:
    return APIError(429, message, code=code, headers={"retry-after": "60"})


def raise_for(code: int, value: int, need: int, per_key: int, total: int, what: str = "batch",
               codes: tuple[str, str] = ("queued_bytes_per_key_exceeded", "queued_bytes_exceeded"),
               less: str = "ask for less (max_tokens, n, top_logprobs)") -> None:
    """429 for a byte limit's refusal (code -1: the key's, -2: everyone's); `what` is refused, answered `codes`;
    `less` says how to need less."""
    held = "open batches, files, sessions and results kept"
    if code == -1:
        raise refuse(f"this API key's {held} already hold about {value} bytes in Redis; with this {what} "
                      f"(about {need}) they would pass max_queued_bytes_per_key {per_key}. Wait for a batch to "
                      f"end or results to expire (result_ttl), delete files you no longer need, or {less}",
                      codes[0])
    if code == -2:
        raise refuse(f"the gateway's {held} already hold about {value} bytes in Redis; with this {what} "
                      f"(about {need}) they would pass max_queued_bytes {total}. Retry later", codes[1])
