"""Hostile jobs against a real worker (issue #13): in-process Server threads with a tiny real Engine on a
real redis-server, and `python -m worker` processes. Each bad job must end alone, with a final status and
an event, without costing its neighbours anything."""

from __future__ import annotations

import json
import time
from collections import Counter, deque

from producer import Client
from protocol import scripts
from protocol.keys import Keys
from protocol.models import GROUP, MAX_STOP_STRINGS

K = Keys("tokenbus")


def submit_raw(r, job_id: str | bytes, request: str | bytes, ttl: int = 600) -> None:
    """A record + entry as a client in another language might write them: no validation at all."""
    code, _ = scripts.script(scripts.SUBMIT_JOB)(keys=[K.job(job_id), K.queue(), K.registry("default")],
                                                 args=[job_id, request, time.time(), 0, ttl, "", "", "default",
                                                       K.layout, GROUP], client=r)
    assert int(code) == 1


def events_per_job(r) -> Counter:
    return Counter(f[b"job_id"].decode("utf-8", "replace") for _id, f in r.xrange(K.events))


def dead_letters(r) -> dict[str, str]:
    return {f[b"job_id"].decode("utf-8", "replace"): f[b"reason"].decode() for _id, f in r.xrange(K.dead)}


def assert_queue_empty(r, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while scripts.queue_totals(r, K) != (0, 0):
        assert time.monotonic() < deadline, scripts.queue_totals(r, K)
        time.sleep(0.05)


def test_undecodable_entries_fail_alone_and_never_wedge_a_read(serve_engine, serve, redis_server):
    r = redis_server.client()
    client = Client(redis_server.url)
    client.submit("creates the group", max_tokens=1)
    bad = {
        "huge-int": ('{"prompt": "hi", "max_tokens": ' + "1" * 5000 + "}", "Exceeds the limit (4300 digits)"),
        "deep": ("[" * 100_000, "nested too deeply"),
        "too-big": (json.dumps({"prompt": "x" * (1 << 20)}), "more than the limit of 1048576"),
        "surrogate": ('{"prompt": "\\ud800"}', "lone surrogate"),
        "not-utf8": (b'{"prompt": "caf\xe9 \xff"}', "not valid UTF-8"),
        "has space": (json.dumps({"prompt": "hi"}), "malformed entry: job_id 'has space'"),
        "newline\n": (json.dumps({"prompt": "hi"}), "malformed entry: job_id 'newline\\n'"),
    }
    good = []
    for i, (job_id, (raw, _)) in enumerate(bad.items()):
        submit_raw(r, job_id, raw)
        good.append(client.submit(f"good {i}", max_tokens=3, temperature=0.0))
    # a valid id whose key is not a record: the start script fails with WRONGTYPE
    r.set(K.job("wrong-type"), "not a hash")
    r.xadd(K.queue(), {"job_id": "wrong-type", "request": json.dumps({"prompt": "hi"})})
    good.append(client.submit("after the wrong type", max_tokens=3, temperature=0.0))
    handle = serve(serve_engine)  # capacity 20: the whole queue arrives in one or two reads

    jobs = {j.id: j for j in client.as_completed(good + list(bad), timeout=120)}
    assert all(jobs[g].status == "finished" and jobs[g].attempts == 1 for g in good)
    for job_id, (_, expect) in bad.items():
        job = jobs[job_id]
        assert job.status == "failed" and job.error_code == "invalid_request", job
        assert expect in job.error, (job_id, job.error)
        assert 0 < r.ttl(K.job(job_id)) <= 600, "an ended record expires"
    assert jobs["not-utf8"].request == {"prompt": "caf\ufffd \ufffd"}, "the record reads back (U+FFFD)"
    dead = dead_letters(r)
    assert "WRONGTYPE" in dead["wrong-type"] and r.get(K.job("wrong-type")) == b"not a hash"
    assert "malformed entry" in dead["has space"] and "malformed entry" in dead["newline\n"]
    ended = events_per_job(r)
    assert all(ended[j] == 1 for j in [*good, *bad]), ended
    assert_queue_empty(r)
    assert handle.server.intake.is_alive() and handle.stop() == 0


# ---- 1: token ids past the vocabulary, and step failures pinned on their job -----------------------------


def long_jobs(client: Client, n: int, max_tokens: int = 60) -> list[str]:
    return client.submit_many([{"prompt": f"long {i}", "max_tokens": max_tokens, "ignore_eos": True,
                                "temperature": 0.0} for i in range(n)])


def test_token_ids_past_the_vocabulary_fail_their_job_alone(serve_engine, serve, redis_server):
    client = Client(redis_server.url)
    vocab = serve_engine.model.arch.vocab_size
    good = long_jobs(client, 4)
    # valid for the protocol (the producer knows no vocabulary), out of range for this model
    bad = [client.submit("poison", stop_token_ids=[10**9], min_tokens=2, max_tokens=5) for _ in range(3)]
    bad.append(client.submit(prompt_token_ids=[1, vocab], max_tokens=3))
    bad.append(client.submit("poison", stop_token_ids=[vocab], max_tokens=3, repetition_penalty=1.2))
    good += long_jobs(client, 2, max_tokens=10)
    handle = serve(serve_engine)
    jobs = {j.id: j for j in client.as_completed(good + bad, timeout=180)}
    for job_id in bad:
        job = jobs[job_id]
        assert job.status == "failed" and job.error_code == "invalid_request", job
        assert f"out of the vocabulary [0, {vocab})" in job.error
    assert all(jobs[g].status == "finished" and jobs[g].attempts == 1 for g in good)
    assert handle.stop() == 0, "the worker kept serving"


def test_sampler_pins_a_row_failure_on_its_request(serve_engine):
    import torch

    from worker.engine.detokenizer import IncrementalDetokenizer
    from worker.engine.errors import EngineFault
    from worker.engine.sampling_params import SamplingParams
    from worker.engine.sequence import Sequence

    def seq(request_id: str, params: SamplingParams) -> Sequence:
        detokenizer = IncrementalDetokenizer(serve_engine.tokenizer, params.skip_special_tokens)
        return Sequence(request_id, [1, 2, 3], params, time.time(), detokenizer)

    ok = seq("ok", SamplingParams(min_tokens=2, stop_token_ids=[5]))
    bad = seq("bad", SamplingParams(min_tokens=2, stop_token_ids=[10**9]))
    logits = torch.zeros(2, serve_engine.model.arch.vocab_size)
    try:
        serve_engine.sampler(logits, [ok, bad])
    except EngineFault as err:  # the engine's own failure (an IndexError inside it), pinned on its row
        assert err.request_id == "bad" and "IndexError" in str(err) and err.code == "worker_error"
    else:
        raise AssertionError("an out-of-range stop token id must fail the sampler")


def test_a_step_failure_is_pinned_on_the_job_that_caused_it(serve_engine, serve, redis_server, monkeypatch):
    # The engine as it was before add_request checked stop_token_ids: the real sampler then raises the real
    # IndexError mid-step. The loop must fail that job alone, leaving the rest of the batch running.
    monkeypatch.setattr(serve_engine, "_check_stop_token_ids", lambda params: None)
    client = Client(redis_server.url)
    good = long_jobs(client, 4)
    bad = [client.submit("poison", stop_token_ids=[10**9], min_tokens=2, max_tokens=5) for _ in range(3)]
    good += long_jobs(client, 2, max_tokens=10)
    handle = serve(serve_engine)
    jobs = {j.id: j for j in client.as_completed(good + bad, timeout=180)}
    for job_id in bad:
        assert jobs[job_id].status == "failed" and jobs[job_id].error_code == "worker_error"
        assert "IndexError" in jobs[job_id].error and jobs[job_id].error.startswith("worker error: the engine failed")
    assert all(jobs[g].status == "finished" and jobs[g].attempts == 1 for g in good)
    assert handle.server.suspects == deque() and handle.server.step_failures == 0, "nobody was isolated"
    assert handle.stop() == 0


def test_three_jobs_that_break_the_engine_do_not_stop_the_worker(serve_engine, serve, redis_server,
                                                                 steps_break_on_breaks_jobs):
    # A probe shows the engine itself works, so none of the three failures counts against it.
    client = Client(redis_server.url)
    good = long_jobs(client, 3, max_tokens=8)
    bad = [client.submit("poisons the batch", job_id=f"breaks-{i}", max_tokens=5) for i in range(3)]
    good += long_jobs(client, 2, max_tokens=8)
    handle = serve(serve_engine)
    jobs = {j.id: j for j in client.as_completed(good + bad, timeout=180)}
    assert all(jobs[b].status == "failed" and jobs[b].error_code == "worker_error" for b in bad)
    assert all(jobs[g].status == "finished" and jobs[g].attempts == 1 for g in good), "no attempt lost"
    assert handle.stop() == 0, "three bad jobs in a row are not a broken engine"


def test_a_broken_engine_still_stops_the_worker(serve_engine, serve, redis_server, monkeypatch):
    def step():
        raise RuntimeError("simulated lost device")

    monkeypatch.setattr(serve_engine, "step", step)
    client = Client(redis_server.url)
    ids = long_jobs(client, 3, max_tokens=8)
    handle = serve(serve_engine)
    handle.thread.join(60)
    assert not handle.thread.is_alive() and handle.exit_code == 1, "the probe fails too: the engine is broken"
    jobs = client.get_many(ids)
    failed = [j for j in jobs if j.status == "failed"]
    assert len(failed) == 1 and failed[0].error_code == "worker_error", "only the isolated job is failed"
    for job in jobs:
        if job.status != "failed":  # handed back (that attempt counted) or never started: queued, not lost
            assert job.status == "queued" and job.attempts <= 1 and job.worker is None, job
    assert not serve_engine.has_unfinished_requests()


# ---- 3: a worker never leases more than max_num_seqs + intake_lookahead jobs -------------------------------


class LeaseWatch:
    """Samples, in a thread, how many jobs one worker holds: its lease registry, its entries pending in the
    group, and the records `running` under its name."""

    def __init__(self, server, r, job_ids: list[str]) -> None:
        import threading

        self.server, self.r, self.job_ids = server, r, job_ids
        self.peak_leases = self.peak_pending = self.peak_running = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        name = self.server.jobs.consumer
        rounds = 0
        while not self.stop.is_set():
            self.peak_leases = max(self.peak_leases, len(self.server.leases))
            rounds += 1
            if rounds % 10 == 0:  # the Redis views are slower to read
                consumers = {c["name"].decode(): c["pending"] for c in self.r.xinfo_consumers(K.queue(), GROUP)}
                self.peak_pending = max(self.peak_pending, consumers.get(name, 0))
                pipe = self.r.pipeline(transaction=False)
                for jid in self.job_ids:
                    pipe.hmget(K.job(jid), "status", "worker")
                running = sum(1 for st, w in pipe.execute() if st == b"running" and w == name.encode())
                self.peak_running = max(self.peak_running, running)
            time.sleep(0.001)

    def finish(self) -> tuple[int, int, int]:
        self.stop.set()
        self.thread.join(5)
        return self.peak_leases, self.peak_pending, self.peak_running


def test_intake_never_leases_more_than_its_capacity(serve_engine, serve, redis_server):
    r = redis_server.client()
    client = Client(redis_server.url)
    # A dead worker's 40 started jobs (their leases lapse) ahead of 260 new ones: reclaimed entries count too.
    ghost = client.submit_many([{"prompt": f"orphan {i}", "max_tokens": 2, "ignore_eos": True} for i in range(40)])
    for entry_id, fields in r.xreadgroup(GROUP, "ghost", {K.queue(): ">"}, count=40)[0][1]:
        assert scripts.start_job(r, K, fields[b"job_id"].decode(), entry_id.decode(), "ghost",
                                 K.queue())[0] == "running"
    fresh = client.submit_many([{"prompt": f"short {i}", "max_tokens": 1 + i % 3, "ignore_eos": True}
                                for i in range(260)])
    ids = ghost + fresh
    handle = serve(serve_engine, max_num_seqs=8, intake_lookahead=4, lease_ms=300)
    watch = LeaseWatch(handle.server, r, ids)
    jobs = list(client.as_completed(ids, timeout=300))
    leases, pending, running = watch.finish()
    assert all(j.status == "finished" for j in jobs)
    assert sum(j.attempts == 2 for j in jobs) == 40, "the ghost's jobs were reclaimed"
    print(f"peak leases {leases}, pending entries {pending}, running records {running}")
    assert 8 <= leases <= 12, f"{leases} jobs leased at once; the limit is max_num_seqs 8 + lookahead 4"
    # records still `running` in Redis also count the jobs that ended in the last step but whose FINISH_JOB the
    # completion writer has not flushed yet: at most one step's endings (max_num_seqs 8) beyond the 12 held
    assert pending <= 12 and running <= 12 + 8, (pending, running)
    assert handle.stop() == 0


# ---- 4: gauges and heartbeat after every running job was cancelled ---------------------------------------


def test_gauges_and_heartbeat_drop_when_cancelled_jobs_leave(serve_engine, serve, redis_server):
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from worker.serve.metrics import WorkerMetrics

    def scrape(port: int) -> dict[str, float]:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}

    metrics = WorkerMetrics(model="tiny", worker="test-worker-0")
    port = metrics.start_http(0, addr="127.0.0.1")
    r = redis_server.client()
    client = Client(redis_server.url)
    total = serve_engine.stats().total_blocks
    try:
        handle = serve(serve_engine, metrics=metrics, heartbeat_s=0.2)
        beat = None
        deadline = time.monotonic() + 30
        while beat is None:
            assert time.monotonic() < deadline, "no heartbeat"
            beat = r.get(K.worker("test-worker-0"))
            time.sleep(0.01)
        assert json.loads(beat)["free_blocks"] == total, "the first heartbeat has free_blocks too"
        ids = long_jobs(client, 3, max_tokens=900)
        deadline = time.monotonic() + 60
        while scrape(port)["tokenbus_running_sequences"] < 3:
            assert time.monotonic() < deadline, "the jobs never ran"
            time.sleep(0.05)
        assert scrape(port)["tokenbus_kv_blocks_used"] > 0
        for job_id in ids:
            assert client.cancel(job_id) == "cancelling"
        assert all(j.status == "cancelled" for j in client.as_completed(ids, timeout=30))
        time.sleep(1.0)  # idle now: no step will run, the loop's idle turns must publish the numbers
        assert not serve_engine.has_unfinished_requests()
        values = scrape(port)
        assert values["tokenbus_running_sequences"] == 0 and values["tokenbus_waiting_sequences"] == 0
        assert values["tokenbus_kv_blocks_used"] == 0 and values["tokenbus_kv_blocks_free"] == total
        beat = json.loads(r.get(K.worker("test-worker-0")))
        assert (beat["running"], beat["waiting"], beat["free_blocks"]) == (0, 0, total), beat
        assert handle.stop() == 0
    finally:
        metrics.stop_http()


def test_a_plain_redis_job_with_a_huge_stop_list_fails_alone(serve_engine, serve, redis_server):
    """A client in another language skips the producer's checks: the worker refuses the stop list itself, so the
    step never checks 20,000 strings after every token for everyone sharing it."""
    r = redis_server.client()
    client = Client(redis_server.url)
    good = long_jobs(client, 2, max_tokens=8)
    request = {"prompt": "x", "max_tokens": 4, "stop": [f"never-{i}" for i in range(20_000)]}
    submit_raw(r, "stops", json.dumps(request))
    handle = serve(serve_engine)
    jobs = {j.id: j for j in client.as_completed([*good, "stops"], timeout=120)}
    assert jobs["stops"].status == "failed" and jobs["stops"].error_code == "invalid_request"
    assert f"at most {MAX_STOP_STRINGS} stop strings" in jobs["stops"].error
    assert all(jobs[g].status == "finished" for g in good)
    assert handle.stop() == 0, "the worker kept serving"
