"""Overlap: step N+1 is scheduled and its inputs prepared while step N runs on the device, and step N's
results (tokens, text, stops, outputs) are handled while step N+1 runs.

    main thread    schedule N+1 ─ prepare N+1 ─ submit N+1 ─ wait N ─ postprocess N ─ schedule N+2 ...
    forward thread ... run N ─────────────────────────────────┘ run N+1 (its carried ids from N's) ─ ...

The forward thread runs ModelRunner.execute (model + sampler) one step at a time, in order; the device work
of a GPU call releases the GIL, so the host work of the main thread goes on meanwhile. A sequence that
samples in step N feeds that token in step N+1 without the host knowing it: its input row is a placeholder
which the forward thread fills from step N's sampled ids on the device (PreparedStep.carry_rows). The
scheduler counts step N's tokens as fed and its sampled tokens as pending (`Ahead`); a sequence that ends in
step N for sure (max_tokens, the context) is left out of step N+1, one that ends otherwise (EOS, a stop
string) runs one row too many, whose token is dropped.

Sequences still change in one place, Scheduler.postprocess(), always for the oldest step. Events that need
step N's results before step N+1 is scheduled break the overlap: that step is finished first, then the next
is scheduled as without overlap (and still runs while the caller works):
- preemption (the scheduler returns None instead of preempting a sequence that is in flight);
- a sampled row of step N with a grammar (its mask in N+1 needs N's token in the matcher), penalties or
  min_tokens still banning stops (they read the token history).
A sequence aborted (or ended by step N) while step N+1 ran is dropped from N+1's results; its blocks were
freed at once, and their next user writes them in a later step, after N+1 on the device.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from worker.engine.guided import GuidedDecoding
from worker.engine.model_runner import ModelRunner
from worker.engine.outputs import RequestOutput
from worker.engine.sampler import SampledStep
from worker.engine.scheduler import Ahead, ScheduledBatch, Scheduler
from worker.engine.sequence import Sequence, SequenceStatus
from worker.engine.step_inputs import PreparedStep

# Engine.finish_step: (batch, its sampled sequences, their tokens, logprob rows) -> the requests that ended
FinishStep = Callable[[ScheduledBatch, list[Sequence], list[int], list | None], list[RequestOutput]]


SWITCH_INTERVAL_S = 0.0002


@dataclass
class InFlight:
    batch: ScheduledBatch
    step: PreparedStep
    future: Future[SampledStep | None]  # the forward thread's execute()
    ahead: Ahead  # what the next schedule counts as fed / pending


class Overlap:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, guided: GuidedDecoding,
                 finish_step: FinishStep) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.guided = guided
        self.finish_step = finish_step
        # the forward thread needs the GIL for a moment between its device calls; the main thread holds it
        # through long stretches of host work, and by default gives it up only every 5 ms
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenbus-forward")
        self.inflight: InFlight | None = None
        self.wait_s = 0.0  # seconds the main thread waited for the device (benchmarks: host = step - wait)
        self.breaks = 0  # steps scheduled after their predecessor finished (an event that breaks the overlap)

    def busy(self) -> bool:
        """A step in flight whose results someone still wants (a step of only gone sequences is not)."""
        f = self.inflight
        return f is not None and any(s.status is SequenceStatus.RUNNING for s in f.batch.seqs)

    def step(self) -> list[RequestOutput]:
        prev = self.inflight
        batch = self.scheduler.schedule(prev.ahead) if prev is not None and self._may_overlap(prev) else None
        outputs: list[RequestOutput] = []
        if batch is None:
            if prev is not None:  # finish it first: the next schedule sees its results
                self.inflight = None
                self.breaks += 1
                outputs = self._finish(prev)
                prev = None
            batch = self.scheduler.schedule()
            assert batch is not None
        if batch.seqs:
            try:
                self.inflight = self._launch(batch, prev)
            except BaseException:
                self.inflight = None
                _drain(prev)
                raise
        else:
            self.inflight = None
        if prev is not None:
            try:
                outputs = self._finish(prev)
            except BaseException:  # its sequences did not change; the step after it is dropped too
                _drain(self.inflight)
                self.inflight = None
                raise
        elif not batch.seqs:
            self.guided.wait(0.01)  # nothing runnable but grammars compiling: do not spin
        return outputs

    def _may_overlap(self, prev: InFlight) -> bool:
        """False when a row sampled in the step in flight needs that token on the host before its next row
        is built: its grammar's mask, its penalties, its min_tokens ban (a row new in the next step reads
        only state that the postprocess of the step in flight does not touch)."""
        matchers = self.guided.matchers
        return not any(s.params.has_penalties or s.params.min_tokens > s.num_output_tokens or s in matchers
                       for s in prev.step.sampling_seqs if s.reads_own_tokens)

    def _launch(self, batch: ScheduledBatch, prev: InFlight | None) -> InFlight:
        step = self.runner.prepare(batch, prev.ahead if prev is not None else None)
        future = self.pool.submit(self._execute, step, prev.future if prev is not None else None)
        src = {seq: i for i, seq in enumerate(step.sampling_seqs)}
        ahead: Ahead = {seq: (n, src.get(seq, -1)) for seq, n in step.order}
        return InFlight(batch, step, future, ahead)

    def _execute(self, step: PreparedStep, prev: Future[SampledStep | None] | None) -> SampledStep | None:
        """On the forward thread. prev is done (one thread, in order); a failed prev fails this step too."""
        prev_tokens = None
        if step.carry_rows is not None:
            assert prev is not None
            sampled = prev.result()
            assert sampled is not None
            prev_tokens = sampled.device_tokens
        return self.runner.execute(step, prev_tokens, resolve_on_device=True)

    def _finish(self, done: InFlight) -> list[RequestOutput]:
        started = time.perf_counter()
        sampled = done.future.result()
        tokens, logprob_rows = sampled.result() if sampled is not None else ([], None)
        self.wait_s += time.perf_counter() - started
        seqs = done.step.sampling_seqs
        batch = done.batch
        if any(s.status is not SequenceStatus.RUNNING for s in batch.seqs):
            batch, seqs, tokens, logprob_rows = _drop_gone(batch, seqs, tokens, logprob_rows)
        return self.finish_step(batch, seqs, tokens, logprob_rows)

    def close(self) -> None:
        _drain(self.inflight)
        self.inflight = None
        self.pool.shutdown(wait=True)


def _drain(inflight: InFlight | None) -> None:
    """Wait for a step whose results are dropped (its device work must end before anything reuses its
    blocks), ignoring its error."""
    if inflight is not None:
        inflight.future.exception()


def _drop_gone(batch: ScheduledBatch, seqs: list[Sequence], tokens: list[int], logprob_rows: list | None):
    """The step without the sequences that left the engine while it ran (aborted, or ended one step
    earlier): their blocks are freed and their tokens belong to no one."""
    live = [(s, n) for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)
            if s.status is SequenceStatus.RUNNING]
    keep = [i for i, s in enumerate(seqs) if s.status is SequenceStatus.RUNNING]
    batch = ScheduledBatch([s for s, _ in live], [n for _, n in live])
    rows = None if logprob_rows is None else [logprob_rows[i] for i in keep]
    return batch, [seqs[i] for i in keep], [tokens[i] for i in keep], rows
