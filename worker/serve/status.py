"""What the worker's heartbeat says about its engine (protocol.records.Heartbeat): the engine's numbers after
the loop's latest turn, which code and kernels run the model, and the latest step times (the dashboard's
sparkline). The serve loop refreshes it; the housekeeper thread reads it for every beat."""

from __future__ import annotations

from collections import deque
from typing import Any

STEP_TIMES_KEPT = 32  # step wall times the heartbeat carries (the dashboard draws them as a sparkline)


class EngineStatus:
    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.step_ms: deque[float] = deque(maxlen=STEP_TIMES_KEPT)
        self._numbers: dict[str, Any] = {}
        self.refresh(engine.stats())  # every field from the first beat on

    def refresh(self, stats: Any) -> None:
        """After every turn of the loop, not only after a step: a cancel or an ending with no step after it (the
        engine went idle) must not leave the last step's numbers up."""
        engine = self.engine
        # one dict swapped in whole: the housekeeper thread reads it without a lock
        self._numbers = {
            "model": engine.model_name, "model_path": engine.model_path, "backend": engine.backend.name,
            "device": str(engine.device), "running": stats.running, "waiting": stats.waiting,
            "free_blocks": stats.free_blocks, "used_blocks": stats.used_blocks,
            "generated_tokens": stats.generated_tokens, "prefix_queried_tokens": stats.prefix_queried_tokens,
            "prefix_hit_tokens": stats.prefix_hit_tokens, "prefix_queried_blocks": stats.prefix_queried_blocks,
            "prefix_hit_blocks": stats.prefix_hit_blocks,
        }

    def step_took(self, seconds: float) -> None:
        self.step_ms.append(round(seconds * 1000, 2))

    def heartbeat(self, jobs_done: int, draining: bool) -> dict[str, Any]:
        return dict(self._numbers, jobs_done=jobs_done, draining=draining, step_ms=list(self.step_ms))
