"""A step that fails: find the job that broke it, fail that one alone, and tell a broken engine from a bad job.

The Server's methods for it (FaultIsolation, a mixin: they act on the Server's running jobs, writer and engine).
A fault the engine attributes to one request fails that request; an unattributed fault with several jobs in the
batch sets them all aside as suspects, re-run one at a time in an otherwise empty engine (jobs arriving meanwhile
are held), so the job that breaks the step fails alone; a fault with one job fails it, and a one-token probe
then says whether the engine itself still works. MAX_STEP_FAILURES in a row end the worker (exit 1).
"""

from __future__ import annotations

from collections import deque
from typing import Any

import structlog

from protocol.models import ErrorCode
from worker.engine.errors import EngineError
from worker.engine.sampling_params import SamplingParams
from worker.serve.embed_jobs import job_of
from worker.serve.messages import HandBack, StartedJob

log = structlog.get_logger("tokenbus.worker")

MAX_STEP_FAILURES = 3  # consecutive failed steps before the worker gives up (exit 1, supervisor restarts it)
CANARY_ID = "tokenbus:canary"  # engine request id of the health probe (job ids cannot contain ':')


class FaultIsolation:
    """Server's step-failure handling. Expects of the Server: engine, writer, running (job id -> StartedJob),
    exit_code, _seat, _end, _fail and _abort_quietly."""

    engine: Any
    writer: Any
    running: dict[str, StartedJob]
    exit_code: int

    def _init_isolation(self) -> None:
        # After a failed step with several jobs: they re-run one at a time (suspects), so the one that
        # breaks the engine fails alone; jobs arriving meanwhile wait in `held`.
        self.suspects: deque[StartedJob] = deque()
        self.isolating: StartedJob | None = None
        self.held: list[StartedJob] = []
        self.step_failures = 0

    def _step_failed(self, err: Exception) -> None:
        culprit = self.running.get(job_of(err.request_id or "")) if isinstance(err, EngineError) else None
        if culprit is not None:
            # The engine named the request whose own row broke the step, before any sequence changed: that
            # job fails (with its constraint's code, or worker_error), the rest of the batch steps on, and the
            # engine is not at fault.
            log.warning("job_broke_step", job_id=culprit.job_id, error=str(err))
            del self.running[culprit.job_id]
            self._abort_quietly(culprit.job_id)
            self._fail(culprit, err)
            return
        self.step_failures += 1
        jobs = list(self.running.values())
        log.exception("engine_step_failed", jobs=[j.job_id for j in jobs], consecutive=self.step_failures)
        for job in jobs:
            self._abort_quietly(job.job_id)
        self.running.clear()
        if len(jobs) == 1 and out_of_memory(err):
            # Not the job's fault but the moment's (or this device's): a transient failure, handed back with the
            # attempt counted, so it runs again after the retry backoff, here or on another worker.
            log.warning("job_out_of_memory", job_id=jobs[0].job_id, error=str(err))
            self.writer.put(HandBack(jobs[0].job_id, jobs[0].entry_id, count_attempt=True, why="out of memory",
                                     queue=jobs[0].queue))
            self.step_failures = 0 if self._engine_works() else MAX_STEP_FAILURES
        elif len(jobs) == 1:
            # Alone in the batch, so it is the one that broke the step: it fails, every other job goes on.
            self._end(jobs[0], "failed", error_code=ErrorCode.worker_error,
                      error=f"worker error: the engine failed while running this job ({type(err).__name__}: "
                            f"{err})")
            # Its fault, or the engine's (a lost GPU fails every job alone too)? A one-token probe in the
            # now empty engine tells: if it runs, the failure was the job's and does not count against us.
            if self._engine_works():
                self.step_failures = 0
            else:
                self.step_failures = MAX_STEP_FAILURES
        else:
            log.warning("isolating_jobs", jobs=[j.job_id for j in jobs])
            self.suspects.extend(jobs)
        if self.step_failures >= MAX_STEP_FAILURES:
            # Several failures in a row, whatever ran: the engine itself is broken (a lost GPU, say).
            log.error("engine_broken", consecutive_failures=self.step_failures)
            self.exit_code = 1

    def _engine_works(self) -> bool:
        """Run a one-token request in the (empty) engine: False if the engine itself fails."""
        try:
            if "generate" in getattr(self.engine, "kinds", ["generate"]):
                self.engine.add_request(CANARY_ID, [0], SamplingParams(max_tokens=1, ignore_eos=True))
            else:  # an encoder: the probe is an embedding of one token
                from worker.engine.pooling import EmbedParams  # torch: the engine's side

                self.engine.add_request(CANARY_ID, [0], EmbedParams())
            for _ in range(8):  # a one-token prompt ends on its first step; a few more cover a busy engine
                if any(out.request_id == CANARY_ID for out in self.engine.step()):
                    return True
            return False
        except Exception:
            log.exception("engine_probe_failed")
            return False
        finally:
            self._abort_quietly(CANARY_ID)

    def _seat_set_aside(self) -> None:
        """Re-run suspects one at a time in an otherwise empty engine, then seat the jobs held meanwhile."""
        if self.isolating is not None and self.isolating.job_id not in self.running:
            self.isolating = None  # it ended (finished, failed or cancelled)
        if self.isolating is not None or self.engine.has_unfinished_requests():
            return
        if self.suspects:
            self.isolating = self.suspects.popleft()
            self._seat(self.isolating)
        elif self.held:
            held, self.held = self.held, []
            for job in held:
                self._seat(job)


def out_of_memory(err: BaseException) -> bool:
    """An out-of-memory error (torch's, or one it caused), however the engine wrapped it."""
    while err is not None:
        if type(err).__name__ == "OutOfMemoryError" or "out of memory" in str(err).lower():
            return True
        err = err.__cause__ or err.__context__
    return False
