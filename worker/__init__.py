"""The tokenbus worker: the continuous-batching engine and the Redis serve loop around it."""

from worker.engine import Engine, EngineStats, RequestOutput
from worker.sampling_params import SamplingParams

__all__ = ["Engine", "EngineStats", "RequestOutput", "SamplingParams"]
