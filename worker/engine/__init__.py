"""The continuous-batching engine: a request's path is engine.py → scheduler.py (with block_manager.py,
sequence.py) → model_runner.py (models/, backends/, sampler.py) → scheduler.postprocess (stop_checker.py,
detokenizer.py) → a RequestOutput.

The names load on first use: worker/settings.py reads EngineConfig (config.py, no torch) from here without
importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from worker.engine.config import EngineConfig
    from worker.engine.engine import Engine
    from worker.engine.outputs import Delta, EngineStats, RequestOutput
    from worker.engine.pooling import EmbedParams
    from worker.engine.sampling_params import SamplingParams

__all__ = ["Delta", "EmbedParams", "Engine", "EngineConfig", "EngineStats", "RequestOutput", "SamplingParams"]

_HOMES = {"EngineConfig": "config", "SamplingParams": "sampling_params", "Delta": "outputs", "EngineStats": "outputs",
          "RequestOutput": "outputs", "EmbedParams": "pooling"}


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("worker.engine." + _HOMES.get(name, "engine")), name)
    raise AttributeError(f"module 'worker.engine' has no attribute {name!r}")
