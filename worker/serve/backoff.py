"""Exponential backoff for the Redis threads: an outage is waited out, never turned into a crash."""

from __future__ import annotations

import random
import threading

import redis
import structlog

# What a Redis outage or restart looks like from redis-py (BusyLoadingError: the server is reading its AOF).
# A Redis Cluster shard that fails over answers CLUSTERDOWN / TRYAGAIN / MASTERDOWN until a replica takes over.
REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError, ConnectionError, OSError,
              redis.exceptions.ClusterDownError, redis.exceptions.TryAgainError, redis.exceptions.MasterDownError)


class Backoff:
    def __init__(self, what: str, stop: threading.Event, first_s: float = 0.05, max_s: float = 5.0) -> None:
        self.what = what
        self.stop = stop
        self.first_s = first_s
        self.max_s = max_s
        self.failures = 0
        self.log = structlog.get_logger("tokenbus.worker")

    def failed(self, err: BaseException) -> None:
        """Log (first failure and then every tenth) and sleep; returns early when stop is set."""
        self.failures += 1
        if isinstance(err, redis.AuthenticationError):  # reachable, but it refuses our credentials
            if self.failures == 1 or self.failures % 10 == 0:
                self.log.error("redis_auth_failed", during=self.what, failures=self.failures, error=str(err),
                               fix="check the user and password in TOKENBUS_REDIS_URL / --redis-url; "
                                   "retrying, so an ACL fix takes effect without a restart")
        elif self.failures == 1 or self.failures % 10 == 0:
            self.log.warning("redis_unavailable", during=self.what, failures=self.failures, error=str(err))
        delay = min(self.max_s, self.first_s * 2 ** min(self.failures - 1, 16))
        self.stop.wait(delay * (0.5 + random.random() / 2))

    def succeeded(self) -> None:
        if self.failures:
            self.log.info("redis_back", during=self.what, after_failures=self.failures)
        self.failures = 0
