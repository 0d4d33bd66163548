"""Polling for a state that Redis reaches by itself (a replica in sync, a promotion, a worker's result)."""

from __future__ import annotations

import time

import redis


def until(predicate, timeout: float, what: str) -> float:
    """Poll until predicate() is true; returns when (monotonic). A Redis that is down or refuses meanwhile
    (a connection error, CLUSTERDOWN, a MOVED not yet followed) counts as false."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if predicate():
                return time.monotonic()
        except (redis.RedisError, OSError):
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)
