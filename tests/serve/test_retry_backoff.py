"""Retries with backoff (START_JOB's "not before"): a job whose worker is SIGKILLed twice finishes on its third
attempt, each retry no sooner than its backoff allows (exponential, jittered), while permanent failures (a
prompt past the context, a prompt plus max_tokens past it) fail at once on their first attempt, never
retried. Three real worker processes on a tiny random-weight model and a real redis-server."""

from __future__ import annotations

import signal
import time

import pytest

from protocol.keys import Keys
from protocol.scripts import RetryBackoff
from tests.serve.test_serve_process import wait_until
from tests.support.worker_runs import worker_args

K = Keys("tokenbus")
LEASE_MS = 1000
BACKOFF = RetryBackoff(base_ms=2000, max_ms=60_000)
RETRIED_TOKENS = 300


@pytest.mark.slow  # three worker processes start
def test_transient_faults_back_off_and_permanent_ones_fail_at_once(redis_server, serve_model_dir, worker_process,
                                                                     make_client):
    model = serve_model_dir  # 1,024 positions: the permanent failures below pass them
    names = ("worker-a", "worker-b", "worker-c")
    workers = {n: worker_process(*worker_args(redis_server.url, model, n, "--lease-ms", str(LEASE_MS),
                                              "--retry-backoff-ms", str(BACKOFF.base_ms), "--max-attempts", "3"))
               for n in names}
    for w in workers.values():
        w.wait_for_event("worker_ready", timeout=180)
    client = make_client()
    r = redis_server.client(decode_responses=True)
    # long enough to be killed mid-run (the kill follows "running" within a poll), short enough for the third
    # attempt to run it all: 2,000 tokens took 82 s there on the reference kernels under a loaded suite
    job = client.submit("retry me", max_tokens=RETRIED_TOKENS, ignore_eos=True, temperature=0.0)

    starts, kills, not_before = [], [], []
    for attempt in (1, 2):
        wait_until(lambda n=str(attempt): r.hget(K.job(job), "status") == "running"
                   and r.hget(K.job(job), "attempts") == n, 60, f"attempt {attempt} running")
        rec = r.hgetall(K.job(job))
        starts.append(float(rec["started_at"]))
        victim = workers.pop(rec["worker"])
        victim.proc.send_signal(signal.SIGKILL)
        kills.append(time.time())
        assert victim.wait(10) == -signal.SIGKILL
        wait_until(lambda n=str(attempt): r.hget(K.job(job), "backoff_attempt") == n, 30,
                   f"the fault of attempt {attempt} seen")
        not_before.append(float(r.hget(K.job(job), "not_before")))
    # permanent failures, submitted once no worker is left to kill (an attempt lost to a kill would count)
    too_long = client.submit_many([{"prompt_token_ids": [5] * 1100, "max_tokens": 4}])[0]
    past_context = client.submit_many([{"prompt": "x", "max_tokens": 1100}])[0]
    done = client.wait(job, timeout=180)
    assert done.status == "finished" and done.attempts == 3, (done.status, done.error)
    assert done.result.usage.completion_tokens == RETRIED_TOKENS
    starts.append(done.started_at)
    survivor = next(iter(workers.values()))
    deferred = [e for e in survivor.events() if e.get("event") == "job_retry_deferred" and e["job_id"] == job]
    assert deferred, "the survivor deferred the retry"
    for k in (1, 2):
        lo, hi = BACKOFF.bounds_s(k)
        # the fault is seen once the lease lapsed; the retry is set lo..hi after that, and runs when due
        assert kills[k - 1] + LEASE_MS / 1000 + lo - 0.1 <= not_before[k - 1], (k, kills, not_before)
        assert not_before[k - 1] <= kills[k - 1] + 3 * LEASE_MS / 1000 + hi + 1.0, (k, kills, not_before)
        assert not_before[k - 1] <= starts[k] <= not_before[k - 1] + LEASE_MS / 1000 + 1.5, (k, starts, not_before)
    # the second retry's wait is the first's doubled (bounds [2, 4) s against [1, 2) s)
    assert starts[2] - kills[1] >= LEASE_MS / 1000 + BACKOFF.bounds_s(2)[0] - 0.1
    assert starts[1] - kills[0] < starts[2] - kills[1] + BACKOFF.bounds_s(1)[1]

    for jid, code in ((too_long, "invalid_request"), (past_context, "invalid_request")):
        failed = client.wait(jid, timeout=30)
        assert failed.status == "failed" and failed.error_code == code, (failed.status, failed.error)
        assert failed.attempts <= 1 and not r.hexists(K.job(jid), "backoff_attempt"), failed
        assert failed.finished_at - failed.created_at < 10, "a permanent failure is not retried"


def test_an_out_of_memory_step_is_retried_after_the_backoff(serve_engine, serve, redis_server, monkeypatch):
    """Fault injection on the real engine: the first step of job oom-1 runs out of memory (torch's own error),
    a transient failure: it is handed back, its attempt counted, and runs again once its backoff has passed."""
    import torch

    from producer.client import Client

    real_step, raised = serve_engine.step, []

    def step():
        if "oom-1" in serve_engine.requests and not raised:
            raised.append(time.time())
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        return real_step()

    monkeypatch.setattr(serve_engine, "step", step)
    client = Client(redis_server.url)
    job = client.submit("out of memory once", job_id="oom-1", max_tokens=4, temperature=0.0)
    handle = serve(serve_engine, retry_backoff_ms=1000)
    done = client.wait(job, timeout=60)
    assert done.status == "finished" and done.attempts == 2, (done.status, done.error)
    r = redis_server.client(decode_responses=True)
    assert r.hget(K.job(job), "backoff_attempt") == "1"
    lo, hi = RetryBackoff(1000).bounds_s(1)
    assert raised[0] + lo - 0.05 <= done.started_at, "the retry waited for its backoff"
    assert float(r.hget(K.job(job), "not_before")) <= done.started_at <= raised[0] + hi + 3.0
    assert handle.stop() == 0, "an out-of-memory step does not stop the worker"
