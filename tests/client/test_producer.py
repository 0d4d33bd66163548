"""Producer side against a real redis-server: submit, validation, idempotency, queue limit, TTL, cancel,
wait, as_completed, info, and the CLI. The worker is played by calling the shared scripts directly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis

from producer import Client, InvalidJob, JobNotFound, QueueFull, WaitTimeout
from protocol import scripts
from protocol.models import GROUP, JobResult, JobStatus, parse_request
from protocol.scripts import finish_job, mark_first_token, start_job

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def client(redis_server):
    with Client(redis_server.url) as c:
        yield c


def deliver(c: Client, count: int = 100, worker: str = "w1") -> dict[str, str]:
    """What a worker's intake does: XREADGROUP entries and start each job. Returns job_id -> entry_id."""
    resp = c.redis.xreadgroup(GROUP, worker, {c.keys.queue(): ">"}, count=count) or []
    out = {}
    for _stream, entries in resp:
        for entry_id, fields in entries:
            status, _ = start_job(c.redis, c.keys, fields["job_id"], entry_id, worker)
            if status == "running":
                out[fields["job_id"]] = entry_id
    return out


def result(text: str = "ok", n_prompt: int = 3) -> JobResult:
    return JobResult.model_validate({
        "text": text, "token_ids": [1, 2], "finish_reason": "length", "model": "smollm2-135m",
        "usage": {"prompt_tokens": n_prompt, "completion_tokens": 2, "total_tokens": n_prompt + 2},
    })


def test_producer_imports_no_torch():
    code = "import producer, producer.cli, producer.batches, sys; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_submit_get_and_stream_entry(client):
    jid = client.submit("Hello there", max_tokens=64, temperature=0.7, stop=["\n"])
    job = client.get(jid)
    assert job.id == jid and job.status == JobStatus.queued and job.attempts == 0
    assert job.request == {"prompt": "Hello there", "max_tokens": 64, "temperature": 0.7, "stop": ["\n"]}
    assert job.created_at == pytest.approx(time.time(), abs=5) and job.result is None
    entries = client.redis.xrange(client.keys.queue())
    assert [(e[0], e[1]["job_id"]) for e in entries] == [(job.entry_id, jid)]
    req = parse_request(entries[0][1]["request"])  # what the worker re-validates
    assert req.engine_prompt() == "Hello there" and req.sampling_fields()["max_tokens"] == 64
    assert req.sampling_fields()["top_p"] == 1.0
    groups = client.redis.xinfo_groups(client.keys.queue())
    assert [g["name"] for g in groups] == [GROUP]

    chat = client.submit(messages=[{"role": "user", "content": "hi"}], job_id="chat-1")
    ids = client.submit(prompt_token_ids=[1, 2, 3], seed=7, logprobs=2)
    assert chat == "chat-1"
    assert client.get(chat).request["messages"] == [{"role": "user", "content": "hi"}]
    # the request is stored once, in the entry (Client.get reads it from there); the record holds short fields
    record = client.redis.hgetall(client.keys.job(ids))
    assert "request" not in record and "id" not in record and record["status"] == "queued"
    entry = client.redis.xrange(record["queue"], record["entry_id"], record["entry_id"])[0][1]
    assert parse_request(entry["request"]).engine_prompt() == [1, 2, 3] == client.get(ids).request["prompt_token_ids"]


@pytest.mark.parametrize("fields, expect", [
    ({"prompt": "x", "temprature": 0.5}, "temprature: unknown field"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens: Input should be greater than or equal to 1 (got 0)"),
    ({"prompt": "x", "top_p": 1.5}, "top_p: Input should be less than or equal to 1"),
    ({"prompt": "x", "temperature": -1}, "temperature: Input should be greater than or equal to 0"),
    ({"prompt": "x", "max_tokens": "64"}, "max_tokens: Input should be a valid integer (got '64')"),
    ({"prompt": "x", "logprobs": 21}, "logprobs: Input should be less than or equal to 20"),
    ({"prompt": "x", "stop": [""]}, "stop strings must not be empty"),
    ({"prompt": "x", "stop": [f"s{i}" for i in range(200_000)]}, "at most 16 stop strings (got 200000)"),
    ({"prompt": "x", "stop": "y" * 1001}, "a stop string has 1001 characters; at most 1000"),
    ({"prompt": "x", "stop_token_ids": list(range(257))}, "at most 256 stop_token_ids (got 257)"),
    ({"max_tokens": 5}, "give exactly one of prompt, messages, prompt_token_ids (got none)"),
    ({"prompt": "x", "prompt_token_ids": [1]}, "(got prompt and prompt_token_ids)"),
    ({"prompt": ""}, "prompt must not be empty"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
])
def test_invalid_jobs_are_refused_and_nothing_is_written(client, fields, expect):
    with pytest.raises(InvalidJob) as err:
        client.submit(**fields)
    assert expect in str(err.value)
    assert client.redis.keys(f"{client.keys.prefix}:job:*") == []
    assert client.redis.exists(client.keys.queue()) == 0 or client.redis.xlen(client.keys.queue()) == 0


def test_submit_many_validates_all_before_writing(client):
    reqs = [{"prompt": f"p{i}"} for i in range(5)]
    reqs[3] = {"prompt": "p3", "bogus": 1}
    with pytest.raises(InvalidJob, match=r"1 of 5 requests are invalid; nothing was submitted:\n  request 3"):
        client.submit_many(reqs)
    assert client.redis.keys(f"{client.keys.prefix}:job:*") == []
    with pytest.raises(InvalidJob, match="invalid job id"):
        client.submit("x", job_id="has space")


def test_idempotent_resubmit_yields_one_job(client):
    a = client.submit("first", job_id="job-42")
    b = client.submit("second", job_id="job-42")
    many = client.submit_many([{"prompt": "third", "job_id": "job-42"}, {"prompt": "new"}],
                              job_ids=[None, "job-43"])
    assert a == b == "job-42" and many == ["job-42", "job-43"]
    assert client.redis.xlen(client.keys.queue()) == 2
    assert client.get("job-42").request["prompt"] == "first"  # the first request wins


def test_queue_full_refuses_and_trims_nothing(redis_server):
    c = Client(redis_server.url, max_queue_len=3)
    ids = c.submit_many([{"prompt": f"p{i}"} for i in range(3)])
    with pytest.raises(QueueFull, match="max_queue_len 3") as err:
        c.submit("one too many")
    assert err.value.accepted == []
    with pytest.raises(QueueFull, match="nothing was submitted"):
        c.submit_many([{"prompt": "a"}, {"prompt": "b"}])
    assert c.redis.xlen(c.keys.queue()) == 3
    assert [j.status for j in c.get_many(ids)] == [JobStatus.queued] * 3
    assert c.submit("again", job_id=ids[0]) == ids[0]  # an idempotent resubmit still answers
    # The limit from {ns}:config applies to clients not given one.
    c.redis.hset(c.keys.config, "max_queue_len", 4)
    c2 = Client(redis_server.url)
    c2.submit("fits")
    with pytest.raises(QueueFull):
        c2.submit("does not")
    assert c.redis.xlen(c.keys.queue()) == 4


def test_finish_sets_result_ttl_and_record_expires(redis_server):
    c = Client(redis_server.url, result_ttl=1)
    jid = c.submit("x", max_tokens=2)
    entry = deliver(c)[jid]
    assert c.get(jid).status == JobStatus.running and c.get(jid).attempts == 1
    assert mark_first_token(c.redis, c.keys, jid)
    assert c.redis.ttl(c.keys.job(jid)) == -1  # no TTL while it runs
    assert finish_job(c.redis, c.keys, jid, "finished", entry_id=entry, result=result("done")) == 1
    job = c.get(jid)
    assert job.status == JobStatus.finished and job.result.text == "done"
    assert job.result.usage.total_tokens == 5
    assert job.created_at <= job.started_at <= job.first_token_at <= job.finished_at
    assert 0 < c.redis.ttl(c.keys.job(jid)) <= 1
    assert c.redis.xlen(c.keys.queue()) == 0 and c.redis.xpending(c.keys.queue(), GROUP)["pending"] == 0
    assert [e[1] for e in c.redis.xrange(c.keys.events)] == [{"job_id": jid, "status": "finished"}]
    time.sleep(1.3)
    with pytest.raises(JobNotFound, match="expired"):
        c.get(jid)


def test_terminal_status_is_never_overwritten(client):
    jid = client.submit("x")
    entry = deliver(client)[jid]
    assert finish_job(client.redis, client.keys, jid, "failed", entry_id=entry, error="boom",
                      error_code="worker_error") == 1
    assert finish_job(client.redis, client.keys, jid, "finished", entry_id=entry, result=result()) == 0
    assert client.cancel(jid) == "failed"
    job = client.get(jid)
    assert job.status == JobStatus.failed and job.result is None and job.error == "boom"
    assert job.error_code == "worker_error"
    assert finish_job(client.redis, client.keys, "never-submitted", "finished") == -1
    with pytest.raises(Exception, match="status must be"):
        finish_job(client.redis, client.keys, jid, "running")


def test_cancel_queued_and_running(client):
    queued, running = client.submit("a"), client.submit("b")
    # Deliver only the first entry ("a") to the worker, then cancel both.
    entries = client.redis.xreadgroup(GROUP, "w1", {client.keys.queue(): ">"}, count=1)[0][1]
    assert client.cancel(running) == "cancelled"  # still queued (never delivered): ends at once
    assert start_job(client.redis, client.keys, queued, entries[0][0], "w1") == ("running", 1)
    assert client.cancel(queued) == "cancelling"
    assert client.redis.sismember(client.keys.cancel, queued)
    job = client.get(running)
    assert job.status == JobStatus.cancelled and job.error_code == "cancelled"
    assert client.redis.xlen(client.keys.queue()) == 1  # the cancelled job's entry is gone
    assert finish_job(client.redis, client.keys, queued, "cancelled", result=result("partial")) == 1
    assert not client.redis.sismember(client.keys.cancel, queued)
    assert [j.status for j in client.as_completed([queued, running], timeout=1)] == ["cancelled"] * 2
    assert client.redis.xlen(client.keys.queue()) == 0
    with pytest.raises(JobNotFound):
        client.cancel("nope")


def test_cancelled_entry_is_skipped_by_start(client):
    jid = client.submit("a")
    entry_id = client.redis.xreadgroup(GROUP, "w1", {client.keys.queue(): ">"})[0][1][0][0]
    assert client.cancel(jid) == "cancelled"  # delivered but not started: still queued
    assert start_job(client.redis, client.keys, jid, entry_id, "w1") == ("cancelled", 0)
    assert client.redis.xpending(client.keys.queue(), GROUP)["pending"] == 0


def test_wait_timeout_and_wait_without_busy_polling(client):
    jid = client.submit("slow")
    before = int(client.redis.info("stats")["total_commands_processed"])
    t0 = time.monotonic()
    with pytest.raises(WaitTimeout) as err:
        client.wait(jid, timeout=0.6)
    elapsed = time.monotonic() - t0
    commands = int(client.redis.info("stats")["total_commands_processed"]) - before
    print(f"wait for 0.6 s sent {commands} Redis commands")
    assert 0.55 < elapsed < 2.0 and err.value.pending == [jid]
    assert commands <= 6, f"wait sent {commands} commands in 0.6 s: it polls"
    with pytest.raises(JobNotFound):
        client.wait("no-such-job", timeout=0.1)


def test_as_completed_yields_in_finish_order(client):
    ids = client.submit_many([{"prompt": f"p{i}"} for i in range(5)])
    entries = deliver(client)
    finish_job(client.redis, client.keys, ids[2], "finished", entry_id=entries[ids[2]], result=result("2"))
    order = [ids[i] for i in (4, 0, 3, 1)]

    def worker():
        for i, jid in enumerate(order):
            time.sleep(0.05)
            status = "failed" if i == 2 else "finished"
            finish_job(client.redis, client.keys, jid, status, entry_id=entries[jid], result=result(jid),
                       error="e" if status == "failed" else None)

    t = threading.Thread(target=worker)
    t.start()
    seen = [(j.id, j.status) for j in client.as_completed(ids, timeout=10)]
    t.join()
    assert [s[0] for s in seen] == [ids[2], *order]
    assert seen[3][1] == JobStatus.failed


def test_get_many_for_as_completed_reads_no_request_of_a_job_still_running(client):
    """as_completed keeps only ended jobs: the running ones' requests (an XRANGE each of their queue entries) are
    not read for it; an ended job still comes with its request, and a plain get_many reads every one."""
    ids = client.submit_many([{"prompt": f"p{i}"} for i in range(4)])
    entries = deliver(client)
    finish_job(client.redis, client.keys, ids[3], "finished", entry_id=entries[ids[3]], result=result("3"))

    def xranges() -> int:
        return int(client.redis.info("commandstats").get("cmdstat_xrange", {}).get("calls", 0))

    before = xranges()
    jobs = client.get_many(ids, ended_requests_only=True)
    assert xranges() == before, "an XRANGE for a job that has not ended"
    assert [j.status for j in jobs] == [JobStatus.running] * 3 + [JobStatus.finished]
    assert jobs[3].request is not None and jobs[3].request["prompt"] == "p3"
    before = xranges()
    assert [j.request["prompt"] for j in client.get_many(ids)] == ["p0", "p1", "p2", "p3"]
    assert xranges() - before == 3


def test_as_completed_resyncs_when_events_are_lost(client):
    jid = client.submit("x")
    entry = deliver(client)[jid]

    def worker():
        time.sleep(0.2)
        # In one transaction, so the blocked reader never sees the event (as if trimmed before it read it).
        pipe = client.redis.pipeline(transaction=True)
        finish_job(pipe, client.keys, jid, "finished", entry_id=entry, result=result())
        pipe.delete(client.keys.events)
        assert pipe.execute() == [1, 1]

    t = threading.Thread(target=worker)
    t.start()
    jobs = list(client.as_completed([jid], timeout=5, resync_every=0.5))
    t.join()
    assert [j.id for j in jobs] == [jid]


def test_info_reports_queue_workers_and_dead_letters(client):
    client.submit_many([{"prompt": f"p{i}"} for i in range(4)])
    # a worker reads one (READ counts it in the depth counter's pending)
    scripts.script(scripts.lua("read"))(keys=[client.keys.routing_key], args=[client.keys.layout, GROUP, "w1", 1],
                                        client=client.redis)
    client.redis.sadd(client.keys.workers, "w1", "w-old")
    beat = {"name": "w1", "model": "smollm2-135m", "started_at": time.time() - 60, "last_seen": time.time(),
            "running": 1, "waiting": 0, "free_blocks": 100, "jobs_done": 7, "model_path": "transformers",
            "backend": "triton", "device": "cuda:0"}
    client.redis.set(client.keys.worker("w1"), json.dumps(beat), ex=30)
    # a 0.2.0 worker sent backend and device as one string: the reader splits it
    client.redis.sadd(client.keys.workers, "w-020")
    old = {"name": "w-020", "last_seen": time.time(), "serving_path": "cpu-cpp on cpu"}
    client.redis.set(client.keys.worker("w-020"), json.dumps(old), ex=30)
    dead = {"job_id": "j", "reason": "max_attempts", "attempts": 3, "request": "{}"}
    client.redis.xadd(client.keys.dead, dead)
    info = client.info()
    assert (info.queue_depth, info.pending, info.waiting, info.dead_letters) == (4, 1, 3, 1)
    assert info.consumers == 2, "the workers whose heartbeat is live (w1 and w-020; w-old's expired)"
    assert [(w.name, w.alive) for w in info.workers] == [("w-020", True), ("w-old", False), ("w1", True)]
    assert (info.workers[0].heartbeat.backend, info.workers[0].heartbeat.device) == ("cpu-cpp", "cpu")
    assert info.workers[2].heartbeat.jobs_done == 7 and info.workers[2].heartbeat.model == "smollm2-135m"
    assert info.workers[2].heartbeat.model_path == "transformers"  # which code serves the model
    from producer.cli import format_info

    assert "model=smollm2-135m path=transformers backend=triton device=cuda:0" in format_info(info)


def test_info_on_an_empty_namespace(client):
    info = client.info()
    assert (info.queue_depth, info.pending, info.consumers, info.workers) == (0, 0, 0, [])


def _cli(url: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "producer", "--url", url, *args], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=60)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def test_cli_submit_get_cancel_info(redis_server):
    url = redis_server.url
    jid = _cli(url, "submit", "Hello", "--max-tokens", "8", "--temperature", "0", "--stop", "\n",
               "--ignore-eos").stdout.strip()
    job = json.loads(_cli(url, "get", jid).stdout)
    assert job["status"] == "queued"
    assert job["request"] == {"prompt": "Hello", "max_tokens": 8, "temperature": 0.0, "stop": ["\n"],
                              "ignore_eos": True}
    assert _cli(url, "cancel", jid).stdout.strip() == "cancelled"
    assert "queue depth     0" in _cli(url, "info").stdout
    bad = _cli(url, "submit", "x", "--top-p", "2", check=False)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert "top_p: Input should be less than or equal to 1" in bad.stderr
    waited = _cli(url, "wait", jid, check=False)
    assert waited.returncode == 3 and json.loads(waited.stdout)["status"] == "cancelled"
    gone = _cli(url, "get", "missing-id", check=False)
    assert gone.returncode == 1 and "not found" in gone.stderr and "Traceback" not in gone.stderr
    redis_server.stop()
    down = _cli(url, "info", check=False)
    assert down.returncode == 1 and "cannot reach Redis" in down.stderr


def test_submit_many_throughput(client):
    n = 20_000
    reqs = [{"prompt": f"prompt number {i}", "max_tokens": 16, "temperature": 0.7} for i in range(n)]
    t0 = time.perf_counter()
    ids = client.submit_many(reqs)
    rate = n / (time.perf_counter() - t0)
    print(f"submit_many: {n} jobs at {rate:,.0f} jobs/s")  # target >= 10k/s; see benchmarks/queue/submit.py
    assert len(set(ids)) == n and client.redis.xlen(client.keys.queue()) == n
    assert client.get(ids[-1]).request["prompt"] == f"prompt number {n - 1}"


def test_client_survives_a_redis_restart(redis_server):
    c = Client(redis_server.url)
    c.submit("before")
    redis_server.restart()  # no persistence: data and loaded scripts are gone
    jid = c.submit("after")  # EVALSHA -> NOSCRIPT -> reloaded; the group is gone too
    ids = c.submit_many([{"prompt": "a"}, {"prompt": "b"}])
    assert c.redis.xlen(c.keys.queue()) == 3 and c.get(jid).status == JobStatus.queued
    assert c.get_many(ids)[1].request == {"prompt": "b"}


def test_wait_longer_than_the_socket_timeout(redis_server):
    # Each XREAD BLOCK must stay under the socket timeout, or a long wait dies with TimeoutError.
    r = redis.Redis.from_url(redis_server.url, decode_responses=True, socket_timeout=0.3)
    c = Client(redis_client=r)
    jid = c.submit("x")
    entry = deliver(c)[jid]
    t = threading.Timer(0.9, lambda: finish_job(c.redis, c.keys, jid, "finished", entry_id=entry,
                                                result=result()))
    t.start()
    assert c.wait(jid, timeout=5).status == JobStatus.finished
    t.join()
