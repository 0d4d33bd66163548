"""The depth counter {ns}:depth equals a recount of every queue after a mixed workload: submits to loose and
batch queues, reads, a worker that dies mid-job and is reclaimed, retried (repeated) scripts, cancels of
queued and running jobs, hand-backs, dropped entries, failures and finishes. On a real redis-server."""

from __future__ import annotations

import time

import pytest

from producer import Client
from protocol import scripts
from worker.serve.job_queue import Ending, JobQueue


def counter(c: Client) -> tuple[int, int]:
    d = scripts.depth(c.redis, c.keys)
    assert sum(d.by_priority.values()) == d.total
    return d.total, d.pending


def check(c: Client) -> tuple[int, int]:
    """The counter and the recount (XLEN and XPENDING summed over every queue) agree."""
    recount = scripts.queue_totals(c.redis, c.keys)
    assert counter(c) == recount
    return recount


def finish(q: JobQueue, entry, status: str = "finished", times: int = 1) -> list:
    """End the job of a delivered entry `times` times (a retry after an unknown outcome repeats the script)."""
    batch = q.write_batch()
    for _ in range(times):
        batch.finish(Ending(entry.fields["job_id"], entry.entry_id, status, queue=entry.queue,
                            error="boom" if status == "failed" else None))
    return batch.execute()


@pytest.fixture
def c(redis_server):
    client = Client(redis_server.url, namespace="depth")
    yield client
    client.close()


def test_the_counter_equals_a_recount_after_a_mixed_workload_with_a_worker_killed_mid_job(c):
    a = JobQueue(c.redis, "depth", "worker-a", 60)
    b = JobQueue(c.redis, "depth", "worker-b", 60)
    a.ensure_group()
    loose = c.submit_many([{"prompt": f"p{i}", "priority": p} for i in range(4)
                           for p in ("interactive", "default", "bulk")])
    c.submit_batch([f'{{"custom_id": "x{i}", "method": "POST", "url": "/v1/completions", '
                    f'"body": {{"prompt": "b{i}"}}}}' for i in range(6)], batch_id="nightly")
    c.submit_batch([f'{{"custom_id": "y{i}", "method": "POST", "url": "/v1/completions", '
                    f'"body": {{"prompt": "y{i}"}}}}' for i in range(3)], batch_id="doomed")
    assert c.submit_many([{"prompt": "again", "job_id": loose[0]}]) == [loose[0]], "an idempotent resubmit"
    assert check(c) == (21, 0)

    # worker a reads 8 and starts them, finishes two (one retried), then is killed mid-job: it never acks the rest
    got = a.read_new(8, None)
    assert len(got) == 8 and check(c) == (21, 8)
    for e in got:
        assert a.start(e.fields["job_id"], e.entry_id, e.queue)[0] == "running"
    assert finish(a, got[0], times=2) == [1, 0]
    assert finish(a, got[1], "failed") == [1]
    assert check(c) == (19, 6)

    # the client cancels a queued job, a running one (a's), and the whole "doomed" batch
    queued = [j for j in loose if j not in {e.fields["job_id"] for e in got}]
    assert c.cancel(queued[0]) == "cancelled" and c.cancel(queued[0]) == "cancelled"
    assert c.cancel(got[2].fields["job_id"]) == "cancelling"
    c.cancel_batch("doomed")
    check(c)

    # a's lease lapses: b reclaims its 6 entries (reclaim moves them: the counts do not change) and runs them
    time.sleep(0.15)
    _, claimed = b.claim_lapsed(100, 20, {})
    assert {e.entry_id for e in claimed} == {e.entry_id for e in got[2:]}
    before = check(c)
    for e in claimed:
        b.start(e.fields["job_id"], e.entry_id, e.queue)
    assert check(c) == before
    # one is handed back (a drain), read again by b's next reclaim; one gets a second entry that b drops
    pipe = c.redis.pipeline()
    b.hand_back(pipe, claimed[0].fields["job_id"], claimed[0].entry_id, claimed[0].queue, count_attempt=False)
    pipe.execute()
    _, again = b.claim_lapsed(1000, 5, {})
    assert [e.entry_id for e in again] == [claimed[0].entry_id]
    dup = c.redis.xadd(c.keys.queue(), {"job_id": claimed[1].fields["job_id"], "request": "{}"})
    c.redis.hincrby(c.keys.depth, "default", 1)  # a plain XADD counts itself, as docs/protocol.md says
    rest = b.read_new(50, None)
    (dup_entry,) = [e for e in rest if e.entry_id == dup]
    b.drop_entry(dup_entry.entry_id, dup_entry.queue)
    b.drop_entry(dup_entry.entry_id, dup_entry.queue)  # repeated: nothing more is counted
    check(c)
    for e in rest:
        if e is not dup_entry and b.start(e.fields["job_id"], e.entry_id, e.queue)[0] == "running":
            finish(b, e)
    check(c)
    for e in claimed:
        finish(b, e, "cancelled" if e.entry_id == got[2].entry_id else "finished", times=2)
    check(c)

    # the rest, read by b: some were cancelled while queued (their entries are still read: start skips them)
    while entries := b.read_new(7, None):
        for e in entries:
            status, _ = b.start(e.fields["job_id"], e.entry_id, e.queue)
            if status == "running":
                finish(b, e)
        check(c)
    assert check(c) == (0, 0)
    assert c.get_batch("nightly").status == "completed" and c.get_batch("doomed").status == "cancelled"
    assert c.redis.zcard(c.keys.ready("bulk")) == 0, "ended and emptied batch queues leave the ready set"


def test_a_missing_counter_is_recounted_once_from_the_queues(c):
    q = JobQueue(c.redis, "depth", "worker-a", 60)
    c.submit_many([{"prompt": f"p{i}"} for i in range(3)])
    c.submit_batch(['{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}'],
                   batch_id="old")
    q.read_new(2, None)
    c.redis.delete(c.keys.depth, c.keys.ready("bulk"))  # a namespace written before the counter existed
    assert counter(c) == scripts.queue_totals(c.redis, c.keys) == (4, 2)
    got = q.read_new(5, None)
    assert sorted(e.queue for e in got) == sorted([c.keys.queue(), c.keys.queue("bulk", "old")]), \
        "the recount put the batch queue back in its ready set: it is read"
    assert check(c) == (4, 4)
