"""The tokenbus worker: the continuous-batching engine (worker/engine/) and the Redis serve loop around it
(worker/serve/).

`from worker import Engine, SamplingParams` works as usual; the names load on first use, so the worker's
settings and CLI parsing do not pay for importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from worker.engine import EmbedParams, Engine, EngineConfig, EngineStats, RequestOutput, SamplingParams

__all__ = ["EmbedParams", "Engine", "EngineConfig", "EngineStats", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        import worker.engine

        return getattr(worker.engine, name)
    raise AttributeError(f"module 'worker' has no attribute {name!r}")
