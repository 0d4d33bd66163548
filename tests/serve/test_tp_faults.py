"""A tensor-parallel worker (TP=2 on the CPU: `python -m worker` and its follower rank) as real processes: one
rank SIGKILLed mid-run, or SIGSTOPped (found by the collective timeout), takes the worker down within 30 s
with a clear log line and exit 3; a second worker then finishes every job, none lost, none ended twice.
SIGTERM drains, then every rank exits 0."""

from __future__ import annotations

import os
import signal
import time

import pytest

from protocol.keys import Keys
from tests.support.worker_runs import check_taken_over, worker_args

K = Keys("tokenbus")
TP_ARGS = ("--tensor-parallel-size", "2", "--tensor-parallel-timeout-s", "4", "--lease-ms", "1500")
LENGTHS = [4] + [64] * 3  # the short job ends before the fault, the long ones are mid-way


def _follower_pid(worker) -> int:
    started = worker.wait_for_event("tensor_parallel_started", timeout=120)
    return started["pids"][1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is no rank
        return f.read().split(") ", 1)[1][0] != "Z"


@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP], ids=["sigkill", "sigstop"])
def test_a_rank_fault_takes_the_worker_down_and_another_finishes_every_job(
    redis_server, serve_model_dir, worker_process, make_client, fault
):
    client = make_client()
    ids = client.submit_many([{"prompt": f"tp fault {i}", "max_tokens": n, "ignore_eos": True,
                               "temperature": 0.0} for i, n in enumerate(LENGTHS)])
    a = worker_process(*worker_args(redis_server.url, serve_model_dir, "worker-a", *TP_ARGS))
    follower = _follower_pid(a)
    a.wait_for_event("job_finished", timeout=120)
    sent = time.monotonic()
    os.kill(follower, fault)
    assert a.wait(30) == 3, a.tail()
    assert time.monotonic() - sent < 30
    faults = [e for e in a.events() if e.get("event") == "tensor_parallel_fault"]
    assert faults and faults[0]["rank"] == 0, a.tail()
    assert ("exited with code" if fault == signal.SIGKILL else "failed") in faults[0]["why"]
    deadline = time.monotonic() + 5
    while _alive(follower) and time.monotonic() < deadline:  # the stopped rank is killed, not left behind
        time.sleep(0.05)
    assert not _alive(follower)
    in_flight = [j for j in client.get_many(ids) if j.status == "running"]
    assert in_flight, "the fault should land while jobs are running"

    b = worker_process(*worker_args(redis_server.url, serve_model_dir, "worker-b", "--lease-ms", "1500"))
    check_taken_over(client, redis_server.client(), ids, LENGTHS, in_flight)
    b.proc.send_signal(signal.SIGTERM)
    assert b.wait(30) == 0


def test_sigterm_drains_then_every_rank_exits_zero(redis_server, serve_model_dir, worker_process, make_client):
    client = make_client()
    job = client.submit("tp drain", max_tokens=24, ignore_eos=True, temperature=0.0)
    a = worker_process(*worker_args(redis_server.url, serve_model_dir, "worker-a", *TP_ARGS))
    follower = _follower_pid(a)
    a.wait_for_event("worker_ready", timeout=120)
    deadline = time.monotonic() + 60
    while not client.get(job).first_token_at:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.kill(follower, signal.SIGTERM)  # as `kill` of the whole group would: the follower ignores it
    a.proc.send_signal(signal.SIGTERM)  # rank 0 drains, then stops its follower
    assert a.wait(60) == 0, a.tail()
    assert client.get(job).status == "finished"
    names = [e.get("event") for e in a.events()]
    assert "tensor_parallel_rank_stopped" in names and names.index("drain_started") < names.index(
        "tensor_parallel_rank_stopped")
    assert not _alive(follower)
