"""`python -m worker` as a real process: SIGKILL mid-batch, SIGTERM drain, start-up errors."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from protocol.keys import Keys
from tests.support.worker_runs import check_taken_over, worker_args

K = Keys("tokenbus")
ROOT = Path(__file__).resolve().parents[2]


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_sigkill_mid_batch_then_another_worker_finishes_everything(
    redis_server, serve_model_dir, worker_process, make_client
):
    client = make_client()
    lengths = [10] + [150] * 7
    ids = client.submit_many([{"prompt": f"crash {i}", "max_tokens": n, "ignore_eos": True,
                               "temperature": 0.0} for i, n in enumerate(lengths)])
    a = worker_process(*worker_args(redis_server.url, serve_model_dir, "worker-a", "--lease-ms", "1500"))
    a.wait_for_event("job_finished", timeout=120)  # the short job is done, the long ones are mid-way
    a.proc.send_signal(signal.SIGKILL)
    assert a.wait(10) == -signal.SIGKILL
    in_flight = [j for j in client.get_many(ids) if j.status == "running"]
    assert in_flight, "the kill should land while jobs are running"

    b = worker_process(*worker_args(redis_server.url, serve_model_dir, "worker-b", "--lease-ms", "1500"))
    jobs = check_taken_over(client, redis_server.client(), ids, lengths, in_flight)
    assert jobs[ids[0]].worker == "worker-a" and jobs[ids[0]].attempts == 1
    assert len(b.events()) > 0 and any(e.get("event") == "entry_reclaimed" for e in b.events())


def test_sigterm_drains_then_exits_zero(redis_server, worker_process, make_client, tmp_path):
    from testbed.tiny_models import make_tiny_model

    # a long context, so the "long" jobs really outlast the grace period even on a fast CPU
    serve_model_dir = make_tiny_model(str(tmp_path / "long-context"), "llama", rope_scaling=None,
                                      max_position_embeddings=8192)
    client = make_client()
    medium = client.submit("medium", max_tokens=30, ignore_eos=True, temperature=0.0)
    # 8000 tokens take the tiny model tens of seconds: far past the grace period
    long_ids = client.submit_many([{"prompt": f"long {i}", "max_tokens": 8000, "ignore_eos": True}
                                   for i in range(2)])
    grace = 6.0
    a = worker_process(*worker_args(redis_server.url, serve_model_dir, "worker-a", "--drain-grace-s",
                                    str(grace)))
    wait_until(lambda: all(j.first_token_at for j in client.get_many([medium, *long_ids])), 120,
               "all three jobs to be generating")
    sent = time.monotonic()
    a.proc.send_signal(signal.SIGTERM)
    assert a.wait(grace + 30) == 0
    assert time.monotonic() - sent < grace + 15
    names = [e["event"] for e in a.events()]
    assert "drain_started" in names and names[-1] == "worker_stopped"

    assert client.get(medium).status == "finished", "a job that fits in the grace period finishes"
    for job in client.get_many(long_ids):
        # handed back unfinished: queued again, and the drain did not count as an attempt
        assert job.status == "queued" and job.attempts == 0 and job.worker is None, job
    r = redis_server.client()
    assert r.get(K.worker("worker-a")) is None, "a drained worker signs off"

    # A worker with a long lease takes them at once: a hand-back does not wait for the lease to lapse.
    b = worker_process(*worker_args(redis_server.url, serve_model_dir, "worker-b", "--lease-ms", "600000"))
    wait_until(lambda: all(j.status == "running" and j.worker == "worker-b"
                           for j in client.get_many(long_ids)), 120, "worker-b to take the jobs")
    for job_id in long_ids:
        assert client.cancel(job_id) == "cancelling"
    assert all(j.status == "cancelled" for j in client.as_completed(long_ids, timeout=60))
    assert all(j.attempts == 1 for j in client.get_many(long_ids))
    b.proc.send_signal(signal.SIGTERM)
    assert b.wait(30) == 0


def test_startup_errors_exit_2_with_a_reason(tmp_path):
    cmd = [sys.executable, "-m", "worker", "--log-json", "true"]

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=120, cwd=ROOT)

    bad_url = run("--redis-url", "nope://x")
    assert bad_url.returncode == 2 and "bad_redis_url" in bad_url.stderr
    bad_model = run("--model", str(tmp_path / "no-such-model"), "--device", "cpu",
                    "--redis-url", "redis://127.0.0.1:1/0")
    assert bad_model.returncode == 2
    assert "engine_load_failed" in bad_model.stderr and "does not exist" in bad_model.stderr
    usage = run("--help")
    assert usage.returncode == 0 and "--lease-ms" in usage.stdout and "TOKENBUS_" in usage.stdout
