"""Issue #22: every batch reaches a terminal state. A submit that hits QueueFull, or whose process is killed,
ends `failed` with errors; a cancel always ends `cancelled`; `expires_at` ends a batch `expired` with its
partial output; the tasks process survives Redis errors and never exits 0 on one it cannot survive."""

from __future__ import annotations

import json
import os
import signal
import time

from testbed.light_gateway import MAX_QUEUE_LEN, chat_line


def test_queue_full_submit_fails_at_once_with_errors(light_stack, tmp_path):
    from producer import Client
    from protocol.keys import Keys
    from protocol.scripts import queue_depth

    r, keys = light_stack.r(), Keys("tokenbus")
    filler = Client(light_stack.redis.url)  # someone filled the queue to its max_queue_len but one
    # (the shared stack has no worker: earlier tests' batches may still be queued)
    filler.submit_many([{"prompt": "x", "max_tokens": 1}] * (MAX_QUEUE_LEN - 1 - queue_depth(r, keys)))
    try:
        t0 = time.monotonic()
        b = light_stack.batch("alice", [chat_line(f"q{i}", "Hi") for i in range(3)], tmp_path)
        done = light_stack.wait_status("alice", b.id, ("failed",), timeout=15)
        took = time.monotonic() - t0
    finally:
        r.xtrim("{tokenbus}:q:default", maxlen=0)
        for chunk in _chunks(r.scan_iter("{tokenbus}:job:*", count=2000)):
            r.unlink(*chunk)
        r.delete(keys.depth)  # trimmed behind the scripts' back: the next script recounts the queues
    assert done.errors.data[0].code == "queue_full" and "queue" in done.errors.data[0].message, done.errors.data
    assert took < 10, f"QueueFull took {took:.1f} s to fail the batch (RQ used to retry for 72 s, then hang)"
    assert not r.keys("{tokenbus}:job:" + b.id + "-*"), "no job of the failed batch is left queued"
    assert r.hget(f"{{tokenbus}}:gw:batch:{b.id}", "bytes_released_at"), "its byte reservation was given back"


def _chunks(it, n=1000):
    chunk = []
    for x in it:
        chunk.append(x)
        if len(chunk) == n:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def test_cancel_ends_cancelled_even_when_no_submit_runs(light_stack, tmp_path):
    light_stack.pause("tasks")  # the submit task will not run: stuck behind others, or its process hung
    try:
        b = light_stack.batch("bob", [chat_line("c", "Hi")], tmp_path)
        assert light_stack.openai("bob").batches.retrieve(b.id).status == "validating"
        cancelled = light_stack.openai("bob").batches.cancel(b.id)
        assert cancelled.status == "cancelled" and cancelled.cancelled_at is not None
    finally:
        light_stack.resume("tasks")
    time.sleep(1.0)  # the submit task now runs, and must not undo the cancel
    again = light_stack.openai("bob").batches.retrieve(b.id)
    assert again.status == "cancelled"
    assert not light_stack.r().exists(f"{{tokenbus}}:batch:{b.id}"), "a cancelled batch was queued anyway"


def test_expiry_ends_batches_expired_with_partial_output(light_stack, tmp_path):
    r, client = light_stack.r(), light_stack.openai("alice")
    # (a) still validating when its window closes (its submit never ran)
    light_stack.pause("tasks")
    try:
        stale = light_stack.batch("alice", [chat_line("s", "Hi")], tmp_path)
        r.hset(f"{{tokenbus}}:gw:batch:{stale.id}", "expires_at", time.time() - 1)
    finally:
        light_stack.resume("tasks")
    # (b) in progress: one line answered, one failed at request level, one never ran
    b = light_stack.batch("alice", [chat_line("ok", "Hi"), chat_line("bad", "Hi"), chat_line("late", "Hi")], tmp_path)
    light_stack.wait_status("alice", b.id, ("in_progress",))
    light_stack.end_job(f"{b.id}-0", text="hello")
    light_stack.end_job(f"{b.id}-1", error_code="model_mismatch")
    r.hset(f"{{tokenbus}}:gw:batch:{b.id}", "expires_at", time.time() - 1)

    assert light_stack.wait_status("alice", stale.id, ("expired",)).output_file_id is None
    done = light_stack.wait_status("alice", b.id, ("expired",))
    assert (done.request_counts.completed, done.request_counts.failed) == (1, 2) and done.expired_at
    output = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    errors = {x["custom_id"]: x for x in map(json.loads, client.files.content(done.error_file_id).text.splitlines())}
    assert [x["custom_id"] for x in output] == ["ok"]
    assert output[0]["response"]["body"]["choices"][0]["message"]["content"] == "hello"
    # OpenAI's shapes: a request that ran and failed carries its HTTP answer; one that never ran, an error.
    bad = errors["bad"]
    assert bad["error"] is None and bad["response"]["status_code"] == 404
    assert bad["response"]["request_id"] == f"{b.id}-1"
    assert bad["response"]["body"]["error"]["code"] == "model_not_found"
    assert errors["late"]["response"] is None and errors["late"]["error"]["code"] == "batch_expired"


def test_killed_submit_ends_failed_and_its_jobs_are_removed(light_stack, tmp_path):
    r = light_stack.r()
    lines = [chat_line(f"k{i}", "Say something long enough " * 4) for i in range(4000)]
    for _attempt in range(3):  # bounded: kill while the submit holds its lease (a 4,000-line write)
        light_stack.pause("tasks")
        b = light_stack.batch("carol", lines, tmp_path)
        light_stack.resume("tasks")
        lease = f"{{tokenbus}}:gw:submit-lease:{b.id}"
        deadline = time.monotonic() + 10
        while not r.exists(lease) and time.monotonic() < deadline:
            time.sleep(0.002)
        os.kill(light_stack.procs["tasks"].proc.pid, signal.SIGKILL)
        light_stack.procs["tasks"].proc.wait(10)
        if not r.hget(f"{{tokenbus}}:gw:batch:{b.id}", "submitted_at"):
            break
        light_stack.start("tasks")  # the submit won the race: try again
    else:
        raise AssertionError("the submit always finished before it could be killed")
    light_stack.start("tasks")  # the supervisor restarts it
    done = light_stack.wait_status("carol", b.id, ("failed",), timeout=20)
    assert done.errors.data[0].code == "submit_failed" and "died" in done.errors.data[0].message
    queued = [k for k in r.scan_iter(f"{{tokenbus}}:job:{b.id}-*", count=1000) if r.hget(k, "status") == "queued"]
    assert not queued, f"{len(queued)} jobs of the failed batch are still queued"


def test_sweep_waits_a_lease_before_a_missing_submit_task_fails_the_batch(redis_server, tmp_path):
    """A batch joins `validating` one round trip before its submit task is queued: a sweep between the two
    must not fail it (the one path that gives the `submit_failed` CI once saw where `queue_full` was due)."""
    from gateway.batches import ingest
    from gateway.batches.records import GatewayBatch
    from gateway.context import GatewayContext
    from gateway.settings import GatewaySettings

    lease_s = 0.5
    ctx = GatewayContext(GatewaySettings(redis_url=redis_server.url, api_keys="k", files_dir=tmp_path,
                                         submit_lease_s=lease_s))
    now = time.time()
    gw = GatewayBatch(id="batch_fresh", owner="key_x", input_file_id="file-x", endpoint="/v1/chat/completions",
                      completion_window="24h", created_at=now, expires_at=now + 86400, total=1)
    ctx.redis.hset(ctx.gkeys.batch(gw.id), mapping=gw.fields())
    ctx.redis.sadd(ctx.gkeys.validating, gw.id)
    assert ingest.sweep_validating(ctx) == 0, "a batch whose submit task is not queued yet was ended"
    assert GatewayBatch.load(ctx.redis, ctx.gkeys, gw.id).final_status is None
    assert ctx.redis.hget(ctx.gkeys.batch(gw.id), "submit_lost_at"), "the sweep keeps its first sighting"
    lease = ingest.SubmitLease(ctx, gw.id, "submit")  # a submit starts: the sighting is void
    assert lease.acquire()
    lease.release()
    assert not ctx.redis.hget(ctx.gkeys.batch(gw.id), "submit_lost_at"), "a lease holder left the sighting"
    assert ingest.sweep_validating(ctx) == 0, "a sighting from before a submit took its lease counted"
    time.sleep(lease_s)
    assert ingest.sweep_validating(ctx) == 1, "a submit task missing for a lease's length ends the batch"
    ended = GatewayBatch.load(ctx.redis, ctx.gkeys, gw.id)
    assert ended.final_status == "failed" and ended.errors[0]["code"] == "submit_failed"
    assert "gone" in ended.errors[0]["message"]
