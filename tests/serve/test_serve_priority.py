"""Priorities through a real worker (tiny random-weight model) on a real redis-server: interactive jobs
overtake a big bulk batch, and a small batch takes turns with a big one of the same priority. Start order is
read from the job records (`started_at`: intake's start script; `first_token_at`: the job's first step in
the engine)."""

from __future__ import annotations

import json
import time

import pytest

from producer import Client
from producer.batches import wait_batch
from protocol.models import Job

MAX_NUM_SEQS = 2


@pytest.fixture(scope="module")
def engine(serve_model_dir):
    from worker import Engine

    return Engine(serve_model_dir, device="cpu", dtype="float32", block_size=16, max_num_seqs=MAX_NUM_SEQS,
                  max_num_batched_tokens=256, kv_cache_gb=0.05)


def lines(n: int, tag: str) -> list[str]:
    return [json.dumps({"custom_id": f"{tag}{i}", "method": "POST", "url": "/v1/completions",
                        "body": {"prompt": f"{tag} item {i}:", "max_tokens": 2 + i % 3, "temperature": 0.0,
                                 "ignore_eos": True}}) for i in range(n)]


def batch_jobs(c: Client, batch_id: str, total: int) -> list[Job]:
    return [j for j in c.get_many([f"{batch_id}-{i}" for i in range(total)]) if j is not None]


def wait_finished(c: Client, batch_id: str, at_least: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while c.get_batch(batch_id).finished < at_least:
        assert time.monotonic() < deadline, c.get_batch(batch_id)
        time.sleep(0.05)


def end_batch(c: Client, batch_id: str) -> None:
    """Cancel what is left; the ended batch's queue must leave the registry and be deleted."""
    c.cancel_batch(batch_id)
    record = wait_batch(c, batch_id, timeout=60)
    assert record.is_terminal and record.queue
    assert c.redis.zscore(c.keys.registry(record.priority), record.queue) is None
    assert not c.redis.exists(record.queue)


def test_interactive_jobs_start_before_the_rest_of_a_500_job_bulk_batch(engine, serve, redis_server):
    lookahead = 24  # a deep look-ahead buffer full of bulk jobs: the engine must seat interactive ones first
    c = Client(redis_server.url)
    bulk = c.submit_batch(lines(500, "bulk"), batch_id="bulk500")
    assert bulk.priority == "bulk"
    serve(engine, max_num_seqs=MAX_NUM_SEQS, intake_lookahead=lookahead)
    wait_finished(c, bulk.id, 20)
    submitted_at = time.time()
    # in one call: five separate submits let the intake read bulk jobs between them, legitimately, and those
    # would count as overtaking
    chat = c.submit_many([{"prompt": f"question {i}", "max_tokens": 3, "temperature": 0.0, "ignore_eos": True,
                           "priority": "interactive"} for i in range(5)])
    chats = list(c.as_completed(chat, timeout=120))
    # The instant intake could first see them: their entries' XADD (Redis's clock, ms), not `submitted_at`. The
    # submit validates, resolves the model and checks capacity first, and while it does, intake goes on reading
    # bulk jobs one free seat at a time, rightly (in the loaded full suite that window let a third one start).
    queued_at = min(int(j.entry_id.split("-")[0]) for j in chats) / 1000
    done = c.get_batch(bulk.id).finished
    wait_finished(c, bulk.id, done + 10)  # bulk work goes on after them
    end_batch(c, bulk.id)

    assert all(j.status == "finished" and j.priority == "interactive" for j in chats)
    bulk_jobs = batch_jobs(c, bulk.id, 500)
    remaining = [j for j in bulk_jobs if j.started_at is None or j.started_at > submitted_at]
    assert len(remaining) > 400, "the interactive jobs came while most of the batch still waited"
    last_chat_start = max(j.started_at for j in chats)
    overtook = [j.id for j in remaining
                if j.started_at is not None and queued_at <= j.started_at < last_chat_start]
    # Only a read already under way when the interactive jobs arrived (at most the free seats) may start first:
    # every later READ takes the interactive queue first (protocol/lua/read.lua), as many as the seats let.
    assert len(overtook) <= MAX_NUM_SEQS, overtook
    assert any(j.started_at and j.started_at > last_chat_start for j in remaining)
    # Seats: bulk jobs already read into the look-ahead (started before the interactive ones were submitted)
    # must not take a seat ahead of them; allow about one seat per interactive job, far below the buffer.
    last_chat_seat = max(j.first_token_at for j in chats)
    seated_between = [j.id for j in bulk_jobs if j.first_token_at and submitted_at < j.first_token_at < last_chat_seat]
    assert len(seated_between) <= 2 * len(chat), seated_between


def test_a_small_batch_takes_turns_with_a_big_one_of_the_same_priority(engine, serve, redis_server):
    c = Client(redis_server.url)
    big = c.submit_batch(lines(200, "big"), batch_id="big")
    serve(engine, max_num_seqs=MAX_NUM_SEQS, intake_lookahead=2)
    wait_finished(c, big.id, 10)
    submitted_at = time.time()
    small = c.submit_batch(lines(5, "small"), batch_id="small")
    assert wait_batch(c, small.id, timeout=120).finished == 5
    end_batch(c, big.id)

    small_starts = sorted(j.started_at for j in batch_jobs(c, small.id, 5))
    big_after = sorted(j.started_at for j in batch_jobs(c, big.id, 200)
                       if j.started_at is not None and j.started_at > submitted_at)
    # Turn by turn: about one big job between two small ones, plus what was read before the small batch came
    # (at most the worker's capacity). First-come-first-served would start ~190 big jobs first.
    between = [t for t in big_after if t < small_starts[-1]]
    assert len(between) <= 5 + MAX_NUM_SEQS + 2, len(between)
    assert len(big_after) > len(between), "the big batch went on after the small one"
