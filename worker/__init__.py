"""The tokenbus worker: the continuous-batching engine and the Redis serve loop around it.

`from worker import Engine, SamplingParams` works as usual; the names load on first use, so the worker's
settings and CLI parsing do not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from worker.engine import Engine, EngineStats, RequestOutput
    from worker.sampling_params import SamplingParams

__all__ = ["Engine", "EngineStats", "RequestOutput", "SamplingParams"]

_HOMES = {"Engine": "worker.engine", "EngineStats": "worker.engine", "RequestOutput": "worker.engine",
          "SamplingParams": "worker.sampling_params"}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'worker' has no attribute {name!r}")
