"""HostTimer: the main thread's CPU time in the engine's host phases (schedule, prepare, postprocess), for the
overlap benchmark (benchmarks/engine/overlap.py) and the GPU check's decode-step stage (gpu_check/stages.py).
Imports nothing: the GPU check loads it on an image without the engine's packages."""

from __future__ import annotations

import time


class HostTimer:
    """CPU seconds of the main thread in the engine's host phases, by wrapping them (nothing in worker/
    changes): schedule, prepare (StepInputs), postprocess (Engine.finish_step: tokens, stops, text, outputs)."""

    def __init__(self, engine) -> None:
        self.totals = {"schedule": 0.0, "prepare": 0.0, "postprocess": 0.0}
        self._wrap(engine.scheduler, "schedule", "schedule")
        self._wrap(engine.runner.inputs, "prepare", "prepare")  # both paths (with and without overlap)
        self._wrap(engine, "finish_step", "postprocess")
        if engine.overlap is not None:
            engine.overlap.finish_step = engine.finish_step  # it holds the method it was built with

    def _wrap(self, obj, name: str, key: str) -> None:
        fn = getattr(obj, name)

        def timed(*args, **kwargs):
            t = time.thread_time()  # CPU time of this thread: the machine's other load does not count
            try:
                return fn(*args, **kwargs)
            finally:
                self.totals[key] += time.thread_time() - t

        setattr(obj, name, timed)

    def take(self) -> dict[str, float]:
        out = dict(self.totals)
        self.totals = dict.fromkeys(self.totals, 0.0)
        return out
