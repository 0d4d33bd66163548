"""Gateway settings: one pydantic-settings model read from TOKENBUS_* / TOKENBUS_GATEWAY_* variables."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from pydantic import AliasChoices, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from protocol.connection import is_cluster_url
from protocol.keys import DEFAULT_NAMESPACE
from protocol.models import DEFAULT_REDIS_URL
from protocol.priority import PRIORITIES, Priority

MiB = 1024 * 1024


def _env(name: str) -> AliasChoices:
    """Shared settings keep the worker's variable names, so one .env serves the worker and the gateway."""
    return AliasChoices(f"TOKENBUS_{name.upper()}", f"TOKENBUS_GATEWAY_{name.upper()}")


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TOKENBUS_GATEWAY_", extra="ignore", populate_by_name=True)

    redis_url: str = Field(DEFAULT_REDIS_URL, validation_alias=_env("redis_url"),
                           description="Redis holding the job stream (TOKENBUS_REDIS_URL, as the worker's)")
    namespace: str = Field(DEFAULT_NAMESPACE, validation_alias=_env("namespace"),
                           description="prefix of every Redis key (TOKENBUS_NAMESPACE, as the worker's)")
    # A plain comma-separated list: pydantic-settings would otherwise want JSON for a list.
    api_keys: str = Field("", description="comma-separated bearer API keys; each key sees only its own objects")
    host: str = Field("127.0.0.1", description="address uvicorn listens on (0.0.0.0 in a container)")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port")
    files_dir: Path = Field(Path("tokenbus-files"), description="volume holding uploaded and output files")
    max_upload_bytes: int = Field(512 * MiB, gt=0, description="largest file upload (bigger: 413)")
    max_body_bytes: int = Field(4 * MiB, gt=0, description="largest JSON request body (bigger: 413)")
    max_line_bytes: int = Field(4 * MiB, gt=0, description="longest line of an uploaded batch file")
    completion_timeout_s: float = Field(600.0, gt=0,
                                         description="longest wait of /v1/chat/completions and /v1/completions")
    stream_threads: int = Field(256, gt=0, description="threads for short blocking calls (Redis reads, files)")
    redis_pool_size: int = Field(64, gt=1, description="connections of the shared Redis pool; a request "
                                                       "waits up to redis_pool_timeout_s for one")
    redis_pool_timeout_s: float = Field(5.0, gt=0, description="longest wait for a pooled Redis connection")
    max_requests_per_key: int = Field(64, gt=0, description="interactive completions one key may have in "
                                                            "flight (streams included); more: 429")
    max_streams_per_key: int = Field(32, gt=0, description="long-lived streams of one key (`stream: true` "
                                                           "completions and dashboard token streams); more: 429")
    max_streams: int = Field(2048, gt=0, description="long-lived streams (API `stream: true` and dashboard "
                                                     "token streams) this gateway process holds in all; more: 503")
    auth_max_failures: int = Field(20, gt=0, description="wrong API keys (bearer or dashboard login) one client "
                                                         "address, or one key, may send in a burst; then 429")
    auth_failure_window_s: float = Field(60.0, gt=0, description="how long a burst of auth_max_failures takes "
                                                                 "to be forgiven (one more every window / max)")
    max_tokens_per_key: int = Field(2_000_000, gt=0, description="tokens (prompt + max_tokens x n) one key's "
                                                                 "interactive requests in flight may ask for")
    max_queued_requests_per_key: int = Field(200_000, gt=0, description="requests one key's unfinished "
                                             "batches may hold; a batch past it: 429 quota_exceeded")
    max_queued_tokens_per_key: int = Field(500_000_000, gt=0, description="tokens (prompt + max_tokens x n) "
                                           "one key's unfinished batches may hold; a batch past it: 429")
    key_priorities: str = Field("", description="KEY=PRIORITY,...: the queue priority (interactive, default, "
                                                "bulk) of a key's completions; KEY is the API key or its owner "
                                                "id (key_...); unlisted keys: interactive")
    webhook_secret: str = Field("", description="master Standard Webhooks secret (whsec_<base64>); each API key "
                                                "signs with its own secret derived from it; unset = webhooks refused")
    webhook_previous_secret: str = Field("", description="the master secret before a rotation: deliveries are "
                                                         "signed with both until it is unset (docs/gateway.md)")
    webhook_retry_intervals: str = Field("5,30,120,600,1800,3600",
                                         description="seconds between webhook attempts (comma-separated)")
    webhook_timeout_s: float = Field(10.0, gt=0, description="one webhook attempt's deadline: connect, send and "
                                                             "the response headers together")
    webhook_allow_networks: str = Field("", description="comma-separated CIDRs webhooks may reach although not "
                                                        "globally routable (e.g. 10.0.0.0/8); empty = public only")
    rq_queue: str = Field("", description="RQ queue of batch submission and finalisation; "
                                          "unset = {namespace}-gateway (webhooks: the same name + -webhooks)")
    rq_redis_url: str = Field("", description="Redis of the RQ task queues; unset = redis_url. Required when "
                                              "redis_url is a Redis Cluster, which RQ cannot use: a plain or "
                                              "Sentinel Redis (docs/deployment.md, Redis Cluster)")
    # Redis capacity: what one tenant, and all of them, may hold queued or kept (estimated bytes, docs/gateway.md).
    # Left unset with a Redis maxmemory, these two are sized to it at start (batches/capacity.py derive_limits).
    max_queued_bytes_per_key: int = Field(512 * MiB, ge=0, description="one key's open batches, results, files' "
                                          "metadata, batch records and sessions kept, in Redis bytes (0 = no "
                                          "limit); unset with a Redis maxmemory: a quarter of max_queued_bytes")
    max_queued_bytes: int = Field(4096 * MiB, ge=0, description="all keys' of the same, in Redis bytes (0 = no "
                                                                "limit); unset with a Redis maxmemory: maxmemory "
                                                                "less redis_reserve_bytes")
    redis_reserve_bytes: int = Field(64 * MiB, ge=0, description="a batch is refused unless Redis keeps this "
                                                                  "much of its maxmemory free after it")
    max_requests_per_file: int = Field(50_000, gt=0, description="lines of one batch input file (OpenAI: 50,000)")
    max_tokens_limit: int = Field(131_072, gt=0, description="largest max_tokens a request may ask for")
    submit_lease_s: float = Field(15.0, gt=0, description="a submit that has not renewed its lease for this "
                                                          "long died with its process: the batch fails")
    tasks_restart_backoff_s: str = Field("1,2,5,10,20,30,60", description="tasks/webhooks: seconds between "
                                         "restarts of an RQ worker that quit on an error; then the process exits 1")
    header_timeout_s: float = Field(10.0, gt=0, description="a request's headers must arrive within this")
    body_grace_s: float = Field(10.0, gt=0, description="a body gets this long before min_body_rate applies")
    min_body_rate: int = Field(16 * 1024, gt=0, description="bytes/s a request body must keep up on average")
    watch_interval_s: float = Field(2.0, gt=0, description="tasks: seconds between scans of open batches")
    batch_retention_s: int = Field(30 * 24 * 3600, ge=0, description="an ended batch's record (and its output and "
                                   "error files, unless output_expires_after says otherwise) is kept this long, "
                                   "then deleted with its entries in the key's list; 0 = kept for good")
    min_output_expires_s: int = Field(3600, ge=1, description="shortest output_expires_after.seconds a batch may "
                                                               "ask for (OpenAI's: 1 hour)")
    # the dashboard at /ui (gateway/ui/, docs/gateway.md "Dashboard")
    ui_enabled: bool = Field(True, description="serve the dashboard at /ui")
    ui_keys: str = Field("", description="comma-separated API keys that may log in to the dashboard; "
                                         "unset = every API key")
    ui_readonly_keys: str = Field("", description="comma-separated API keys that log in to the dashboard "
                                                  "read-only (they see, but retry, delete and cancel nothing)")
    ui_operator_keys: str = Field("", description="comma-separated API keys that operate the deployment in the "
                                                  "dashboard: every key's dead letters (others see only their "
                                                  "own); unset = no operator")
    ui_session_ttl_s: int = Field(8 * 3600, gt=0, description="a dashboard session's lifetime")
    ui_max_sessions_per_key: int = Field(16, gt=0, description="live dashboard sessions of one key; a new "
                                                               "login past it ends that key's oldest session")
    ui_secure_cookie: bool | None = Field(None, description="Secure session cookie; unset = when the request "
                                                            "came over HTTPS (X-Forwarded-Proto too)")
    log_level: str = Field("info", validation_alias=_env("log_level"), description="debug, info, warning, error")
    log_json: bool | None = Field(None, validation_alias=_env("log_json"),
                                  description="JSON logs; unset = JSON when stderr is not a TTY")

    @field_validator("key_priorities")
    @classmethod
    def _priorities(cls, v: str) -> str:
        for item in (x.strip() for x in v.split(",")):
            key, sep, priority = item.rpartition("=")
            if item and (not sep or not key.strip() or priority.strip() not in PRIORITIES):
                raise ValueError(f"give KEY=PRIORITY pairs separated by commas, PRIORITY one of "
                                 f"{', '.join(PRIORITIES)} (got {item!r})")
        return v

    @field_validator("webhook_retry_intervals")
    @classmethod
    def _intervals(cls, v: str) -> str:
        if not re.fullmatch(r"\s*\d+\s*(,\s*\d+\s*)*", v):
            raise ValueError(f"give whole seconds separated by commas, e.g. 5,30,120 (got {v!r})")
        return v

    @field_validator("tasks_restart_backoff_s")
    @classmethod
    def _backoff(cls, v: str) -> str:
        try:
            assert [float(x) for x in v.split(",")]
        except (ValueError, AssertionError):
            raise ValueError(f"give seconds separated by commas, e.g. 1,2,5 (got {v!r})") from None
        return v

    @model_validator(mode="after")
    def _rq_not_on_a_cluster(self) -> GatewaySettings:
        # RQ keeps global keys (rq:queues, rq:workers) beside each queue's and moves jobs between them in
        # MULTI blocks: on a cluster those span slots (CROSSSLOT), so its queues need a Redis of their own.
        if is_cluster_url(self.rq_redis_url or self.redis_url):
            raise ValueError("RQ cannot run on a Redis Cluster: with redis_url a redis+cluster:// URL, set "
                             "TOKENBUS_GATEWAY_RQ_REDIS_URL to a plain redis:// (or redis+sentinel://) Redis for "
                             "the gateway's task queues (small: a few KB per batch)")
        return self

    @field_validator("webhook_allow_networks")
    @classmethod
    def _networks(cls, v: str) -> str:
        import ipaddress

        for n in (x.strip() for x in v.split(",")):
            if n:
                ipaddress.ip_network(n, strict=False)  # ValueError names the bad one
        return v

    @property
    def keys_by_owner(self) -> dict[str, str]:
        """owner id -> API key. The owner id (a hash) is what Redis records hold: never the key itself."""
        return {owner_id(k): k for k in (k.strip() for k in self.api_keys.split(",")) if k}

    @property
    def ui_login_owners(self) -> set[str]:
        return {owner_id(k) for k in (k.strip() for k in self.ui_keys.split(",")) if k}

    @property
    def ui_readonly_owners(self) -> set[str]:
        return {owner_id(k) for k in (k.strip() for k in self.ui_readonly_keys.split(",")) if k}

    @property
    def ui_operator_owners(self) -> set[str]:
        return {owner_id(k) for k in (k.strip() for k in self.ui_operator_keys.split(",")) if k}

    @property
    def priority_by_owner(self) -> dict[str, str]:
        """owner id -> the priority of that key's completions (key_priorities)."""
        out = {}
        for item in (x.strip() for x in self.key_priorities.split(",")):
            if item:
                key, _, priority = item.rpartition("=")
                out[key if key.startswith("key_") else owner_id(key)] = Priority(priority.strip()).value
        return out

    @property
    def retry_intervals(self) -> list[int]:
        return [int(x) for x in self.webhook_retry_intervals.split(",")]

    @property
    def queue_name(self) -> str:
        return self.rq_queue or f"{self.namespace}-gateway"

    @property
    def webhook_queue_name(self) -> str:
        return f"{self.queue_name}-webhooks"


def owner_id(api_key: str) -> str:
    return "key_" + hashlib.sha256(api_key.encode()).hexdigest()[:24]
