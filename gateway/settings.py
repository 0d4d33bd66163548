"""Gateway settings: one pydantic-settings model read from TOKENBUS_* / TOKENBUS_GATEWAY_* variables."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from pydantic import AliasChoices, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from protocol.models import DEFAULT_NAMESPACE, DEFAULT_REDIS_URL

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
    stream_threads: int = Field(256, gt=0, description="concurrent blocking waits (streams) of one gateway")
    webhook_secret: str = Field("", description="Standard Webhooks signing secret (whsec_<base64>); "
                                                "unset = webhooks are refused")
    webhook_retry_intervals: str = Field("5,30,120,600,1800,3600",
                                         description="seconds between webhook attempts (comma-separated)")
    webhook_timeout_s: float = Field(10.0, gt=0, description="one webhook POST's timeout")
    webhook_allow_private: bool = Field(False, description="allow webhook URLs that resolve to loopback, private "
                                                           "or link-local addresses (off: no SSRF into your network)")
    rq_queue: str = Field("", description="RQ queue of batch submission, finalisation and webhooks; "
                                          "unset = {namespace}-gateway")
    watch_interval_s: float = Field(2.0, gt=0, description="tasks: seconds between scans of open batches")
    log_level: str = Field("info", validation_alias=_env("log_level"), description="debug, info, warning, error")
    log_json: bool | None = Field(None, validation_alias=_env("log_json"),
                                  description="JSON logs; unset = JSON when stderr is not a TTY")

    @field_validator("webhook_retry_intervals")
    @classmethod
    def _intervals(cls, v: str) -> str:
        if not re.fullmatch(r"\s*\d+\s*(,\s*\d+\s*)*", v):
            raise ValueError(f"give whole seconds separated by commas, e.g. 5,30,120 (got {v!r})")
        return v

    @property
    def keys_by_owner(self) -> dict[str, str]:
        """owner id -> API key. The owner id (a hash) is what Redis records hold: never the key itself."""
        return {owner_id(k): k for k in (k.strip() for k in self.api_keys.split(",")) if k}

    @property
    def retry_intervals(self) -> list[int]:
        return [int(x) for x in self.webhook_retry_intervals.split(",")]

    @property
    def queue_name(self) -> str:
        return self.rq_queue or f"{self.namespace}-gateway"


def owner_id(api_key: str) -> str:
    return "key_" + hashlib.sha256(api_key.encode()).hexdigest()[:24]
