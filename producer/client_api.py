"""ClientApi: what producer/waiting.py and producer/batches.py use of producer.Client, named once here so that
neither imports the client back (client.py imports both)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import redis

from protocol.keys import Keys
from protocol.models import Job
from protocol.scripts import CHUNK, PendingJob


class ClientApi(Protocol):
    redis: redis.Redis
    keys: Keys

    @property
    def max_block_s(self) -> float: ...
    @property
    def result_ttl(self) -> int: ...
    @property
    def max_queue_len(self) -> int: ...

    def get(self, job_id: str) -> Job: ...
    def get_many(self, job_ids: Iterable[str], ended_requests_only: bool = False) -> list[Job | None]: ...
    def events_last_id(self) -> str: ...
    def enqueue(self, jobs: list[PendingJob], chunk_size: int = CHUNK) -> list[str]: ...
    def check_capacity(self, n: int, model_id: str = "") -> None: ...
