"""Fairness (#22 attack 8): bulk requests keep a minimum share of the seats however many interactive ones
wait (Scheduler.bulk_min_seats), and the n - 1 choices of an n > 1 job waiting to fork take seats."""

from __future__ import annotations

import time

import pytest

from worker.engine.block_manager import BlockManager
from worker.engine.config import EngineConfig, bulk_min_seats
from worker.engine.sampling_params import SamplingParams
from worker.engine.scheduler import Scheduler
from worker.engine.sequence import Sequence
from worker.engine.stop_checker import StopChecker

INTERACTIVE, BULK = 0, 2


def seq(rid: str, priority: int) -> Sequence:
    return Sequence(rid, [1, 2, 3, 4], SamplingParams(max_tokens=4), time.time(), detokenizer=None,
                    priority=priority)


def seated(reserve: int) -> list[str]:
    sched = Scheduler(BlockManager(64, 4), StopChecker([0]), max_num_seqs=4, max_num_batched_tokens=64,
                      bulk_min_seats=reserve)
    for i in range(2):
        sched.add(seq(f"bulk{i}", BULK))  # the batch came first ...
    for i in range(6):
        sched.add(seq(f"chat{i}", INTERACTIVE))  # ... and interactive traffic queues ahead of it
    batch = sched.schedule()
    return [s.request_id for s in batch.seqs]


def test_bulk_keeps_its_reserved_seats_under_interactive_load():
    assert seated(0) == ["chat0", "chat1", "chat2", "chat3"]  # pure priority: the batch starves
    assert seated(1) == ["bulk0", "chat0", "chat1", "chat2"]
    assert seated(2) == ["bulk0", "bulk1", "chat0", "chat1"]


def test_reserve_is_a_rounded_up_fraction_of_the_seats():
    assert [bulk_min_seats(f, 8) for f in (0, 0.1, 0.25, 0.3, 1.0)] == [0, 1, 2, 3, 8]
    assert bulk_min_seats(0.25, 64) == 16
    with pytest.raises(ValueError, match="bulk_min_fraction"):
        EngineConfig(bulk_min_fraction=1.5)
