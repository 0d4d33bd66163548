"""Worker settings: one pydantic-settings model. Environment (TOKENBUS_*) first, CLI flags override. The engine's
settings are EngineConfig's fields and defaults (worker/engine/config.py); engine_config() hands them over whole."""

from __future__ import annotations

import argparse
import os
import socket
from typing import Any

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from protocol.models import DEFAULT_MAX_QUEUE_LEN, DEFAULT_RESULT_TTL
from worker.engine.config import EngineConfig

_ENGINE = EngineConfig()  # the engine's defaults are the worker's: one definition


def _default_worker_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class WorkerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TOKENBUS_", extra="forbid")

    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis server holding the job stream")
    namespace: str = Field("tokenbus", description="prefix of every Redis key")
    model: str = Field(_ENGINE.model, description="model name, local HF dir, hub id or GGUF file")
    device: str = Field(_ENGINE.device, description="'auto' (cuda if available, else cpu), 'cpu', 'cuda', 'cuda:N'")
    dtype: str = Field(_ENGINE.dtype, description="'auto' (bfloat16 on cuda, float32 on cpu), or a torch dtype name")
    block_size: int = Field(_ENGINE.block_size, gt=0, description="tokens per KV-cache block")
    max_num_seqs: int | None = Field(
        _ENGINE.max_num_seqs, gt=0, description="most sequences in one batch; unset = 256 on cuda, 64 on cpu"
    )
    max_num_batched_tokens: int = Field(
        _ENGINE.max_num_batched_tokens, gt=0, description="token budget of one engine step"
    )
    max_model_len: int | None = Field(
        _ENGINE.max_model_len, gt=1, description="longest prompt + output in tokens; unset = the model's context"
    )
    kv_cache_gb: float | None = Field(
        _ENGINE.kv_cache_gb, gt=0,
        description="KV-cache size in GiB; unset = from gpu_memory_utilization (cuda) or 1 GiB",
    )
    gpu_memory_utilization: float = Field(
        _ENGINE.gpu_memory_utilization, gt=0, le=1,
        description="share of GPU memory the worker may use (weights + KV cache)",
    )
    cpu_kernels: bool = Field(
        _ENGINE.cpu_kernels,
        description="CPU float32: run the C++ kernels (built once per machine, ~25 s); false = PyTorch references",
    )
    cache_dir: str | None = Field(
        _ENGINE.cache_dir, description="dequantised GGUF weights and built CPU kernels; unset = ~/.cache/tokenbus"
    )
    model_impl: str = Field(
        _ENGINE.model_impl, description="'auto' (tokenbus's own model code where it has the family, else "
        "transformers'), 'transformers' (always transformers' modeling code), 'native' (refuse the fallback)",
    )
    enable_prefix_caching: bool = Field(
        _ENGINE.enable_prefix_caching, description="reuse cached KV blocks of a shared prompt prefix across jobs"
    )
    cuda_graphs: bool = Field(_ENGINE.cuda_graphs, description="CUDA: replay captured graphs for pure decode steps")
    quantization: str | None = Field(
        _ENGINE.quantization,
        description="weight quantization: unset = as loaded; 'int8' (CPU float32, per-channel weight-only)",
    )
    worker_name: str = Field(default_factory=_default_worker_name, description="consumer name in the group")
    lease_ms: int = Field(
        30_000, ge=100, description="an in-flight job whose lease is not renewed for this long is reclaimed"
    )
    max_attempts: int = Field(3, ge=1, description="deliveries of one job before it goes to the dead letters")
    result_ttl_s: int = Field(
        DEFAULT_RESULT_TTL, gt=0,
        description="seconds an ended job's record is kept (when set, also published to {ns}:config for clients)",
    )
    max_queue_len: int = Field(
        DEFAULT_MAX_QUEUE_LEN, gt=0,
        description="queue depth at which submits are refused (when set, published to {ns}:config for clients)",
    )
    intake_lookahead: int = Field(4, ge=0, description="jobs read beyond the free seats, so none sit idle")
    drain_grace_s: float = Field(
        30.0, ge=0, description="on SIGTERM: seconds to finish in-flight jobs before handing them back"
    )
    heartbeat_s: float = Field(5.0, gt=0, description="seconds between heartbeats")
    metrics_port: int = Field(0, ge=0, description="Prometheus /metrics port; 0 = off")
    stream_tokens: bool = Field(True, description="publish partial tokens of jobs that asked for stream=true")
    log_level: str = Field("info", description="debug, info, warning, error")
    log_json: bool | None = Field(None, description="JSON logs; unset = JSON when stderr is not a TTY")

    @field_validator("log_level")
    @classmethod
    def _known_level(cls, v: str) -> str:
        v = v.lower()
        if v not in ("debug", "info", "warning", "error", "critical"):
            raise ValueError(f"unknown log level {v!r}")
        return v

    def engine_config(self) -> EngineConfig:
        """The engine's settings, handed to Engine whole (ValueError if they do not fit together)."""
        return EngineConfig(**{name: getattr(self, name) for name in EngineConfig.__dataclass_fields__
                               if name in type(self).model_fields})

    def queue_config(self) -> dict[str, int]:
        """The queue limits the operator set explicitly (env or flag): the producers' {ns}:config."""
        names = {"max_queue_len": "max_queue_len", "result_ttl_s": "result_ttl"}
        return {key: getattr(self, name) for name, key in names.items() if name in self.model_fields_set}


def _flag_type(annotation: Any):
    if annotation in (int, int | None):
        return int
    if annotation in (float, float | None):
        return float
    return str


def _parse_bool(text: str) -> bool:
    low = text.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    """One flag per setting (--redis-url for redis_url ...), help text from the field descriptions."""
    parser = argparse.ArgumentParser(
        prog="tokenbus-worker",
        description="Serve tokenbus jobs from a Redis stream on one GPU (or the CPU). "
        "Every flag may also be set as TOKENBUS_<NAME> in the environment.",
    )
    for name, field in WorkerSettings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        if field.annotation in (bool, bool | None):
            parser.add_argument(flag, type=_parse_bool, nargs="?", const=True, default=None,
                                metavar="BOOL", help=field.description)
        else:
            parser.add_argument(flag, type=_flag_type(field.annotation), default=None, help=field.description)
    return parser


def load_settings(argv: list[str] | None = None) -> WorkerSettings:
    args = build_parser().parse_args(argv)
    overrides = {k: v for k, v in vars(args).items() if v is not None}
    return WorkerSettings(**overrides)
