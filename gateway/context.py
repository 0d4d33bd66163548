"""What the HTTP app and the tasks process share: Redis connections, the producer Client, files, the RQ queue."""

from __future__ import annotations

from functools import cached_property

import redis
from rq import Queue

from gateway.files.store import FileStore
from gateway.keys import GatewayKeys
from gateway.live.cancels import Canceller
from gateway.live.quotas import KeyQuotas
from gateway.live.streams import StreamHub
from gateway.live.waiter import JobWaiter
from gateway.settings import GatewaySettings
from gateway.throttle import AuthThrottle
from producer.client import Client
from protocol.connection import is_cluster_url, is_sentinel_url, redis_from_url
from protocol.keys import Keys


class GatewayContext:
    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.keys = Keys(settings.namespace)
        self.gkeys = GatewayKeys(settings.namespace)
        # Blocking reads (XREAD BLOCK) stay under the socket timeout: Client.max_block_s reads it.
        if is_sentinel_url(settings.redis_url) or is_cluster_url(settings.redis_url):
            # The sentinels' pool follows the primary, a cluster client keeps a pool per shard (no bounded wait).
            self.redis = redis_from_url(settings.redis_url, decode_responses=True, socket_timeout=30,
                                        socket_connect_timeout=5, health_check_interval=30)
        else:
            # A bounded pool that makes a request wait (redis_pool_timeout_s) for a connection when all are busy,
            # instead of failing it; no request holds one while it waits on a job (live/waiter.py, live/streams.py).
            pool = redis.BlockingConnectionPool.from_url(
                settings.redis_url, max_connections=settings.redis_pool_size, timeout=settings.redis_pool_timeout_s,
                decode_responses=True, socket_timeout=30, socket_connect_timeout=5, health_check_interval=30)
            self.redis = redis.Redis(connection_pool=pool)
        self.client = Client(redis_client=self.redis, namespace=settings.namespace)
        self.files = FileStore(self.redis, self.gkeys, settings.files_dir, settings.max_line_bytes,
                               settings.max_tokens_limit, settings.max_requests_per_file,
                               lambda: (settings.max_queued_bytes_per_key, settings.max_queued_bytes))
        self.api_keys = settings.keys_by_owner
        self.waiter = JobWaiter(self.client)  # its thread starts with the HTTP app, never in tasks
        # Streams, cancels and /healthz each have their own connection: none depends on the shared pool.
        self.streams = StreamHub(settings.redis_url, self.keys)
        self.cancels = Canceller(settings.redis_url, self.keys)
        self.quotas = KeyQuotas(settings.max_requests_per_key, settings.max_streams_per_key,
                                settings.max_tokens_per_key, max_streams_total=settings.max_streams)
        self.priorities = settings.priority_by_owner
        self.auth_throttle = AuthThrottle(settings.auth_max_failures, settings.auth_failure_window_s)

    @cached_property
    def rq_redis(self) -> redis.Redis:
        # RQ stores pickled job data: it needs a connection that returns bytes. Never a cluster (settings.py).
        return redis_from_url(self.settings.rq_redis_url or self.settings.redis_url, socket_timeout=30,
                              socket_connect_timeout=5, health_check_interval=30)

    @cached_property
    def queue(self) -> Queue:
        return Queue(self.settings.queue_name, connection=self.rq_redis)

    @cached_property
    def webhook_queue(self) -> Queue:
        """Deliveries wait on their own queue, worked by their own process: a slow receiver delays no submit."""
        return Queue(self.settings.webhook_queue_name, connection=self.rq_redis)

    def close(self) -> None:
        self.streams.stop()
        self.cancels.stop()
        self.redis.close()
        if "rq_redis" in self.__dict__:
            self.rq_redis.close()
