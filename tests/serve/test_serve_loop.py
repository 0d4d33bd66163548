"""The serve loop in-process (a Server thread) with a tiny real Engine and a real redis-server: round trips,
results as each job ends, poison entries, cancel, streaming, attempts, idempotency, TTL, queue limits."""

from __future__ import annotations

import json
import os
import time
from collections import Counter

import pytest

from protocol import scripts
from protocol.errors import JobNotFound, QueueFull
from protocol.keys import Keys
from protocol.records import Heartbeat
from worker import SamplingParams
from worker.serve.job_queue import tokens_key

K = Keys("tokenbus")


def events_per_job(r) -> Counter:
    return Counter(f[b"job_id"].decode() for _id, f in r.xrange(K.events))


def submit_raw(r, job_id: str, request_json: str) -> None:
    """Queue a record + entry exactly as a producer would, but with a request no client would send."""
    keys, args = scripts.submit_args(K, scripts.PendingJob(job_id, request_json), time.time(), 0, 600)
    code, _ = scripts.script(scripts.SUBMIT_JOB)(keys=keys, args=args, client=r)
    assert int(code) == 1


def assert_queue_empty(r) -> None:
    depth, pending = scripts.queue_totals(r, K)
    assert depth == 0, "every ended job's entry is deleted"
    assert pending == 0, "every ended job's entry is acknowledged"


def test_round_trip_matches_offline_engine(serve_engine, serve, make_client, redis_server):
    prompts = [f"Item {i}: the weather today is" for i in range(12)]
    params = [dict(max_tokens=4 + i % 5, temperature=0.0, ignore_eos=True) for i in range(12)]
    params[3] = dict(max_tokens=6, temperature=0.9, seed=7, ignore_eos=True)  # seeded sampling too
    params[5] = dict(max_tokens=6, temperature=0.0, logprobs=2, ignore_eos=True)
    expected = serve_engine.generate(prompts, [SamplingParams(**p) for p in params])

    handle = serve(serve_engine)
    client = make_client()
    ids = client.submit_many([{"prompt": p, **kw} for p, kw in zip(prompts, params, strict=True)])
    jobs = {j.id: j for j in client.as_completed(ids, timeout=180)}

    r = redis_server.client()
    for job_id, exp in zip(ids, expected, strict=True):
        job = jobs[job_id]
        assert job.status == "finished", job
        assert job.result.token_ids == exp.token_ids
        assert job.result.text == exp.text
        assert job.result.finish_reason == "length"
        assert job.result.usage.completion_tokens == len(exp.token_ids)
        assert job.result.usage.prompt_tokens == len(exp.prompt_token_ids)
        assert job.attempts == 1 and job.worker == "test-worker-0"
        assert job.created_at <= job.started_at <= job.first_token_at <= job.finished_at
    lp = jobs[ids[5]].result.logprobs
    assert lp is not None and len(lp) == len(expected[5].token_ids)
    assert events_per_job(r) == Counter(ids)
    assert_queue_empty(r)
    deadline = time.monotonic() + 5
    while (heartbeat := json.loads(r.get(K.worker("test-worker-0"))))["jobs_done"] < 12:
        assert time.monotonic() < deadline, heartbeat
        time.sleep(0.1)
    assert heartbeat["name"] == "test-worker-0" and heartbeat["running"] == 0
    assert heartbeat["model_path"] == "native"  # the tiny Llama runs on tokenbus's own model code
    # what the worker writes is the protocol's Heartbeat, field for field (a client drops nothing)
    assert set(heartbeat) == set(Heartbeat.model_fields) and heartbeat["pid"] == os.getpid()
    assert heartbeat["draining"] is False
    assert handle.stop() == 0
    assert r.get(K.worker("test-worker-0")) is None, "a stopped worker signs off"
    assert serve_engine.stats().used_blocks == 0


def test_results_arrive_as_each_job_ends(serve_engine, serve, make_client):
    serve(serve_engine)
    client = make_client()
    long_ids = client.submit_many([{"prompt": f"long {i}", "max_tokens": 120, "ignore_eos": True,
                                    "temperature": 0.0} for i in range(3)])
    short_id = client.submit("short", max_tokens=2, temperature=0.0, ignore_eos=True)
    first = next(iter(client.as_completed(long_ids + [short_id], timeout=120)))
    assert first.id == short_id and first.status == "finished"
    # the short job's result is out while every long one is still generating
    assert [j.status for j in client.get_many(long_ids)] == ["running"] * 3
    done = list(client.as_completed(long_ids, timeout=180))
    assert all(j.status == "finished" for j in done)
    assert min(j.finished_at for j in done) > first.finished_at


def test_poison_entries_fail_alone(serve_engine, serve, make_client, redis_server):
    r = redis_server.client()
    client = make_client()
    client.submit("warm up", max_tokens=1)  # creates the group
    r.xadd(K.queue(), {"garbage": "no job id here"})
    r.xadd(K.queue(), {"job_id": "no-record", "request": json.dumps({"prompt": "hi"})})
    bad = {
        "bad-json": ("{not json", "not valid JSON"),
        "unknown-field": (json.dumps({"prompt": "hi", "temperatur": 0.5}), "temperatur: unknown field"),
        "bad-value": (json.dumps({"prompt": "hi", "temperature": -1.0}), "temperature"),
        "two-prompts": (json.dumps({"prompt": "hi", "prompt_token_ids": [1]}), "exactly one of"),
        "wrong-model": (json.dumps({"prompt": "hi", "model": "gpt-99"}), "gpt-99"),
        "too-long-prompt": (json.dumps({"prompt_token_ids": [5] * 1100}), "context"),
        "too-many-tokens": (json.dumps({"prompt": "hi", "max_tokens": 5000}), "exceeds the model context"),
        "out-of-vocab": (json.dumps({"prompt_token_ids": [10**7]}), "vocabulary"),
        "empty-request": ("", "not valid JSON"),
    }
    good = []
    for i, (job_id, (raw, _)) in enumerate(bad.items()):
        submit_raw(r, job_id, raw)
        good.append(client.submit(f"good {i}", max_tokens=3, temperature=0.0))
    serve(serve_engine)

    for job in client.as_completed(good + list(bad), timeout=180):
        if job.id in bad:
            assert job.status == "failed", job
            assert bad[job.id][1] in job.error, (job.id, job.error)
        else:
            assert job.status == "finished", job
    codes = {j.id: j.error_code for j in client.get_many(bad)}
    assert codes["wrong-model"] == "model_mismatch"
    assert codes["too-long-prompt"] == codes["bad-json"] == "invalid_request"
    dead = [{k.decode(): v.decode() for k, v in f.items()} for _id, f in r.xrange(K.dead)]
    reasons = {d["job_id"]: d["reason"] for d in dead}
    assert "malformed entry" in reasons[""]
    assert "no job record" in reasons["no-record"]
    assert r.exists(K.job("no-record")) == 0, "a worker never invents a record"
    time.sleep(0.3)
    assert_queue_empty(r)


def test_cancel_queued_and_running(serve_engine, serve, make_client, redis_server):
    r = redis_server.client()
    client = make_client()
    queued = client.submit("never runs", max_tokens=5)
    assert client.cancel(queued) == "cancelled"
    running = client.submit("runs long", max_tokens=400, ignore_eos=True, temperature=0.0)
    short = client.submit("short", max_tokens=4, temperature=0.0, ignore_eos=True)
    serve(serve_engine)
    deadline = time.monotonic() + 60
    while client.get(running).first_token_at is None:
        assert time.monotonic() < deadline, "the long job never started"
        time.sleep(0.05)
    asked = time.time()
    assert client.cancel(running) == "cancelling"
    job = client.wait(running, timeout=30)
    assert job.status == "cancelled" and job.error_code == "cancelled"
    assert job.result.finish_reason == "abort"
    assert 0 < job.result.usage.completion_tokens < 400
    assert job.finished_at - asked < 5.0, "a cancelled job leaves the batch within a step or so"
    assert client.wait(short, timeout=60).status == "finished"
    q = client.get(queued)
    assert q.status == "cancelled" and q.attempts == 0 and q.started_at is None
    assert r.scard(K.cancel) == 0
    assert serve_engine.stats().used_blocks == 0, "the cancelled job's KV blocks are free"
    assert events_per_job(r) == Counter([queued, running, short])


def test_streamed_tokens_add_up_to_the_result(serve_engine, serve, make_client, redis_server):
    serve(serve_engine)
    client = make_client()
    job_id = client.submit("stream me", max_tokens=12, temperature=0.0, ignore_eos=True, stream=True)
    plain = client.submit("no stream", max_tokens=3)
    job = client.wait(job_id, timeout=120)
    client.wait(plain, timeout=120)
    r = redis_server.client()
    chunks = [{k.decode(): v.decode() for k, v in f.items()} for _id, f in r.xrange(tokens_key(K, job_id))]
    tokens, offset = [], 0
    for c in chunks:
        assert int(c["offset"]) == offset, "chunks are contiguous"
        ids = json.loads(c["token_ids"])
        tokens += ids
        offset += len(ids)
    assert tokens == job.result.token_ids
    assert chunks[-1]["done"] == "1" and all(c["done"] == "0" for c in chunks[:-1])
    assert "".join(c["text"] for c in chunks) == job.result.text
    assert r.ttl(tokens_key(K, job_id)) > 0
    assert r.exists(tokens_key(K, plain)) == 0
    # the client's reader gives the same, ending on the done chunk; a non-streaming job just ends
    streamed = list(client.stream(job_id, timeout=30))
    assert [t for c in streamed for t in c.token_ids] == job.result.token_ids and streamed[-1].done
    assert "".join(c.text for c in streamed) == job.result.text
    assert list(client.stream(plain, timeout=30)) == []


def test_exhausted_attempts_go_to_dead_letters(serve_engine, serve, make_client, redis_server):
    r = redis_server.client()
    client = make_client()
    job_id = client.submit("crashed its workers twice", max_tokens=3)
    r.hset(K.job(job_id), "attempts", 2)  # two workers died running it already
    ok = client.submit("fine", max_tokens=3)
    serve(serve_engine, max_attempts=2)
    job = client.wait(job_id, timeout=60)
    assert job.status == "failed" and job.error_code == "max_attempts"
    assert "max_attempts=2" in job.error
    dead = [{k.decode(): v.decode() for k, v in f.items()} for _id, f in r.xrange(K.dead)]
    assert [(d["job_id"], d["attempts"]) for d in dead] == [(job_id, "2")]
    assert json.loads(dead[0]["request"])["prompt"] == "crashed its workers twice"
    assert client.wait(ok, timeout=60).status == "finished"


def test_resubmit_ttl_and_queue_limit(serve_engine, serve, make_client, redis_server):
    client = make_client(max_queue_len=3, result_ttl=2)
    ids = [client.submit(f"job {i}", job_id=f"job-{i}", max_tokens=2) for i in range(3)]
    with pytest.raises(QueueFull, match="max_queue_len 3"):
        client.submit("one too many", max_tokens=2)
    assert client.submit("same id: no new job", job_id="job-0", max_tokens=2) == "job-0"
    serve(serve_engine)
    assert all(j.status == "finished" for j in client.as_completed(ids, timeout=120))
    assert client.submit("resubmitted after it ended", job_id="job-0", max_tokens=2) == "job-0"
    extra = client.submit("room again", max_tokens=2)
    assert client.wait(extra, timeout=60).status == "finished"
    job0 = client.get("job-0")
    assert job0.attempts == 1 and job0.result.usage.completion_tokens == 2
    assert events_per_job(redis_server.client())["job-0"] == 1
    time.sleep(2.5)
    with pytest.raises(JobNotFound):
        client.get("job-0")  # the record expired result_ttl seconds after the job ended


def test_openai_batch_round_trip(serve_engine, serve, make_client, tmp_path):
    lines = [
        {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": f"Say {i}"}],
                  "max_tokens": 3 + i, "temperature": 0}}
        for i in range(4)
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    serve(serve_engine)
    client = make_client()
    rec = client.submit_batch(str(src), model="")  # "": any worker's model
    from producer.batches import wait_batch

    rec = wait_batch(client, rec.id, timeout=120)
    assert (rec.status, rec.finished, rec.failed) == ("completed", 4, 0)
    out = tmp_path / "out.jsonl"
    assert client.export_batch(rec.id, out) == 4
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [row["custom_id"] for row in rows] == [f"req-{i}" for i in range(4)]
    for i, row in enumerate(rows):
        body = row["response"]["body"]
        assert row["error"] is None
        assert body["usage"]["completion_tokens"] <= 3 + i
        job = client.get(row["response"]["request_id"])
        assert body["choices"][0]["message"]["content"] == job.result.text


def test_two_workers_share_the_group(serve_engine, serve_model_dir, serve, make_client, redis_server):
    from worker import Engine

    cfg = serve_engine.config
    second = Engine(serve_model_dir, device="cpu", dtype="float32", max_num_seqs=cfg.max_num_seqs,
                    max_num_batched_tokens=cfg.max_num_batched_tokens, kv_cache_gb=cfg.kv_cache_gb)
    client = make_client()
    ids = client.submit_many([{"prompt": f"split {i}", "max_tokens": 8, "ignore_eos": True}
                              for i in range(24)])
    # small capacities so that neither worker can take the whole queue in one read
    serve(serve_engine, max_num_seqs=4, intake_lookahead=0)
    serve(second, max_num_seqs=4, intake_lookahead=0)
    jobs = list(client.as_completed(ids, timeout=180))
    assert all(j.status == "finished" and j.attempts == 1 for j in jobs)
    by_worker = Counter(j.worker for j in jobs)
    assert set(by_worker) == {"test-worker-0", "test-worker-1"}, by_worker
    assert events_per_job(redis_server.client()) == Counter(ids)


def test_a_job_that_breaks_the_engine_step_fails_alone(serve_engine, serve, make_client,
                                                       steps_break_on_breaks_jobs):
    # The loop must find the job that breaks every step it is in, fail it, and finish the ones batched with it.
    client = make_client()
    good = client.submit_many([{"prompt": f"fine {i}", "max_tokens": 5, "ignore_eos": True} for i in range(4)])
    client.submit("poisons the batch", job_id="breaks-1", max_tokens=5)
    good += client.submit_many([{"prompt": f"after {i}", "max_tokens": 5, "ignore_eos": True}
                                for i in range(2)])
    handle = serve(serve_engine)
    jobs = {j.id: j for j in client.as_completed([*good, "breaks-1"], timeout=120)}
    bad = jobs.pop("breaks-1")
    assert bad.status == "failed" and bad.error_code == "worker_error"
    assert "simulated kernel fault" in bad.error
    assert all(j.status == "finished" and j.attempts == 1 for j in jobs.values())
    assert handle.stop() == 0, "one broken job does not stop the worker"


def test_metrics_and_queue_config(serve_engine, serve, make_client, redis_server):
    from worker.serve.metrics import WorkerMetrics

    metrics = WorkerMetrics(model="tiny", worker="test-worker-0")
    client = make_client()
    ids = client.submit_many([{"prompt": f"count {i}", "max_tokens": 3, "ignore_eos": True} for i in range(3)])
    bad = client.submit("too long", max_tokens=5000)
    serve(serve_engine, metrics=metrics, max_queue_len=500)
    list(client.as_completed([*ids, bad], timeout=120))
    value = metrics.registry.get_sample_value
    deadline = time.monotonic() + 5  # the writer counts a job right after its ending is written
    while value("tokenbus_generated_tokens_total") < 9 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert value("tokenbus_jobs_started_total") == 3
    assert value("tokenbus_jobs_finished_total", {"reason": "length"}) == 3
    assert value("tokenbus_jobs_failed_total", {"reason": "invalid_request"}) == 1
    assert value("tokenbus_generated_tokens_total") == 9
    assert value("tokenbus_job_latency_seconds_count") == 4  # the failed job had started too
    assert metrics.health()[0]
    # an explicitly configured limit reaches the producers through {ns}:config
    assert redis_server.client().hget(K.config, "max_queue_len") == b"500"
    assert make_client().max_queue_len == 500
