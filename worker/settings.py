"""Worker settings: one pydantic-settings model. Environment (TOKENBUS_*) first, CLI flags override. The engine's
settings are one EngineConfig (worker/engine/config.py: their fields, defaults and checks), nested as `engine`
and set flat like the others (TOKENBUS_MODEL, --model)."""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import asdict, fields, replace
from typing import Any, get_type_hints

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from protocol.models import DEFAULT_MAX_QUEUE_LEN, DEFAULT_REDIS_URL, DEFAULT_RESULT_TTL
from protocol.registry import model_name_problem
from worker.engine.config import EngineConfig

ENV_PREFIX = "TOKENBUS_"
ENGINE_FIELDS = tuple(f.name for f in fields(EngineConfig))
DEFAULT_LORA_SLOTS = 8  # device slots a worker given --lora and no --max-loras takes
WORKER_BULK_MIN_FRACTION = 0.25  # the worker's default share of seats kept for bulk jobs (EngineConfig's is 0)
# The CLI help of the engine's settings (their types and defaults are EngineConfig's)
ENGINE_HELP = {
    "model": "model name, local HF dir, hub id or GGUF file",
    "device": "'auto' (cuda if available, else cpu), 'cpu', 'cuda', 'cuda:N'",
    "dtype": "'auto' (bfloat16 on cuda, float32 on cpu), or a torch dtype name",
    "block_size": "tokens per KV-cache block",
    "max_num_seqs": "most sequences in one batch; unset = 256 on cuda, 64 on cpu",
    "max_num_batched_tokens": "token budget of one engine step",
    "max_model_len": "longest prompt + output in tokens; unset = the model's context",
    "kv_cache_gb": "KV-cache size in GiB; unset = from gpu_memory_utilization (cuda) or 1 GiB",
    "gpu_memory_utilization": "share of GPU memory the worker may use (weights + KV cache)",
    "num_kv_blocks": "a fixed KV-cache block count (tests, benchmarks); overrides both sizes above",
    "cpu_kernels": "CPU float32: run the C++ kernels (built once per machine, ~40 s); false = PyTorch references",
    "cache_dir": "dequantised GGUF weights and built CPU kernels; unset = ~/.cache/tokenbus",
    "model_impl": "'auto' (tokenbus's own model code where it has the family, else transformers'), "
    "'transformers' (always transformers' modeling code), 'native' (refuse the fallback)",
    "bulk_min_fraction": "share of the seats kept for bulk jobs (batches) while some are queued, so interactive "
    "traffic cannot starve them (the worker's default: 0.25)",
    "enable_prefix_caching": "reuse cached KV blocks of a shared prompt prefix across jobs",
    "cuda_graphs": "CUDA: replay captured graphs for pure decode steps",
    "static_decode": "the fixed-shape padded decode path; unset = on with CUDA graphs, off on the CPU",
    "overlap": "schedule and prepare step N+1 while step N runs; unset = on for cuda, off on the cpu",
    "quantization": "weight quantization: unset = as loaded (an FP8 checkpoint serves FP8 on a GPU); 'int8' (CPU "
                    "float32, per-channel weight-only); 'w8a8' (CPU float32, int8 weights and activations rounded "
                    "to int8 per token and group of 64: faster on VNNI CPUs); 'fp8' (GPU sm_89+, e4m3 weights per "
                    "channel)",
    "tensor_parallel_size": "shard the model over this many processes, one per GPU (cuda:0.. from --device); "
    "rank 0 serves, the others follow; a safetensors checkpoint of a native family",
    "tensor_parallel_timeout_s": "seconds a rank may wait in a collective before the worker counts a rank as "
    "hung and exits (code 3)",
    "kv_cache_dtype": "KV-cache dtype: 'auto' (the model's), 'bfloat16', 'float32', 'int8' (CPU, scaled per "
    "token and head: ~3.8x the tokens of float32), 'fp8' (CUDA sm_89+, e4m3 with the same scales)",
    "max_loras": "LoRA adapter slots on the device (0 = LoRA off); docs/adapters.md",
    "max_lora_rank": "the largest LoRA rank a slot holds (memory per slot grows with it)",
    "max_cpu_loras": "LoRA adapters kept in host memory for reloading into slots; unset = max_loras",
    "cascade_attention": "decode rows sharing a cached prefix read it once per step: 'auto' (where the cost rule "
    "says it pays), 'on' (every such row), 'off'",
}


class _FlatEngineEnv(PydanticBaseSettingsSource):
    """TOKENBUS_<ENGINE FIELD> environment variables, into `engine` (the env source reads only top fields)."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        found = {name: os.environ[ENV_PREFIX + name.upper()] for name in ENGINE_FIELDS
                 if ENV_PREFIX + name.upper() in os.environ}
        return {"engine": found} if found else {}


def _default_worker_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class WorkerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid")

    redis_url: str = Field(DEFAULT_REDIS_URL, description="Redis server holding the job stream")
    namespace: str = Field("tokenbus", description="prefix of every Redis key")
    # The engine's settings, whole (worker/engine/config.py: their types, defaults and checks). They are given
    # flat as ever: TOKENBUS_MODEL, --model, WorkerSettings(model=...) (see _flat_engine_settings).
    engine: EngineConfig = Field(default_factory=lambda: EngineConfig(bulk_min_fraction=WORKER_BULK_MIN_FRACTION),
                                 description="the engine's settings (EngineConfig)")
    worker_name: str = Field(default_factory=_default_worker_name, description="consumer name in the group")
    served_model_name: list[str] = Field(
        default_factory=list,
        description="a name jobs may give for this worker's model (repeatable; the first is the model's id in the "
        "registry and in results, else the checkpoint's short name); env: a JSON list",
    )
    lora: list[str] = Field(
        default_factory=list,
        description="a LoRA adapter to serve as a model of its own, NAME=PATH (a PEFT directory; repeatable; env: a "
        "JSON list), its base this worker's model; without --max-loras: a slot per adapter, up to 8 "
        "(docs/adapters.md)",
    )
    lease_ms: int = Field(
        30_000, ge=100, description="an in-flight job whose lease is not renewed for this long is reclaimed"
    )
    max_attempts: int = Field(3, ge=1, description="deliveries of one job before it goes to the dead letters")
    retry_backoff_ms: int = Field(1000, ge=0, description="a job whose worker stopped (or whose step failed) is "
                                  "retried after min(retry_backoff_max_ms, this x 2^(attempt-1)) x [0.5, 1)")
    retry_backoff_max_ms: int = Field(60_000, ge=0, description="the longest wait between two attempts of a job")
    result_ttl_s: int = Field(
        DEFAULT_RESULT_TTL, gt=0,
        description="seconds an ended job's record is kept (when set, also published to {ns}:config for clients)",
    )
    max_queue_len: int = Field(
        DEFAULT_MAX_QUEUE_LEN, gt=0,
        description="queue depth at which submits are refused (when set, published to {ns}:config for clients)",
    )
    redis_min_replicas: int = Field(
        0, ge=0, description="after writing results, WAIT until this many replicas have them; 0 = do not wait",
    )
    redis_wait_ms: int = Field(1000, gt=0, description="longest WAIT for --redis-min-replicas, in milliseconds")
    intake_lookahead: int = Field(4, ge=0, description="jobs read beyond the free seats, so none sit idle")
    intake_max_waiting: int | None = Field(
        None, ge=1, description="most jobs held here that no seat has taken yet (on their way to the engine, "
        "waiting for a seat or KV blocks): the rest stay queued, where an autoscaler sees them; unset = up to "
        "max_num_seqs + intake_lookahead",
    )
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

    @field_validator("lora")
    @classmethod
    def _adapter_flags(cls, v: list[str]) -> list[str]:
        for flag in v:
            name, eq, path = flag.partition("=")
            problem = model_name_problem(name) if eq and path else "give it as NAME=PATH"
            if problem:
                raise ValueError(f"--lora {flag!r}: {problem}")
        if len(set(lora_flags(v))) < len(v):
            raise ValueError(f"--lora {v}: an adapter name is given twice")
        return v

    @model_validator(mode="after")
    def _slots_for_adapters(self) -> WorkerSettings:
        """Adapters asked for by flag and no slots: one slot per adapter (up to DEFAULT_LORA_SLOTS)."""
        if self.lora and self.engine.max_loras == 0:
            self.engine = replace(self.engine, max_loras=min(len(self.lora), DEFAULT_LORA_SLOTS))
        return self

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings):
        return init_settings, env_settings, _FlatEngineEnv(settings_cls), dotenv_settings, file_secret_settings

    @model_validator(mode="before")
    @classmethod
    def _flat_engine_settings(cls, data: Any) -> Any:
        """model=..., max_num_seqs=... given at the top land in `engine` (over what `engine` already holds)."""
        if isinstance(data, dict) and any(name in data for name in ENGINE_FIELDS):
            data = dict(data)
            engine = data.get("engine") or {}
            engine = asdict(engine) if isinstance(engine, EngineConfig) else dict(engine)
            data["engine"] = engine | {name: data.pop(name) for name in ENGINE_FIELDS if name in data}
        if isinstance(data, dict) and isinstance(data.get("engine"), dict):
            # the worker keeps seats for bulk jobs unless told otherwise (an Engine of its own keeps none)
            data = dict(data)
            data["engine"] = {"bulk_min_fraction": WORKER_BULK_MIN_FRACTION} | data["engine"]
        return data

    def queue_config(self) -> dict[str, int]:
        """The queue limits the operator set explicitly (env or flag): the producers' {ns}:config."""
        names = {"max_queue_len": "max_queue_len", "result_ttl_s": "result_ttl"}
        return {key: getattr(self, name) for name, key in names.items() if name in self.model_fields_set}


def lora_flags(flags: list[str]) -> dict[str, str]:
    """--lora NAME=PATH flags as name -> path."""
    return dict(flag.partition("=")[::2] for flag in flags)


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
    options = [(name, field.annotation, field.description) for name, field in WorkerSettings.model_fields.items()
               if name != "engine"]
    hints = get_type_hints(EngineConfig)
    options += [(name, hints[name], ENGINE_HELP.get(name)) for name in ENGINE_FIELDS]
    for name, annotation, help_text in options:
        flag = "--" + name.replace("_", "-")
        if annotation == list[str]:
            parser.add_argument(flag, action="append", default=None, metavar="NAME", help=help_text)
        elif annotation in (bool, bool | None):
            parser.add_argument(flag, type=_parse_bool, nargs="?", const=True, default=None,
                                metavar="BOOL", help=help_text)
        else:
            parser.add_argument(flag, type=_flag_type(annotation), default=None, help=help_text)
    return parser


def load_settings(argv: list[str] | None = None) -> WorkerSettings:
    args = build_parser().parse_args(argv)
    overrides = {k: v for k, v in vars(args).items() if v is not None}
    return WorkerSettings(**overrides)
