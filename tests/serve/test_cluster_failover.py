"""Redis Cluster failover: the shard that holds a namespace loses its primary (SIGKILL mid-run, together with
one of the two workers) on a local cluster of 3 primaries with 1 replica each. The cluster promotes the
replica by itself; the surviving worker and a client that is submitting meanwhile, both on a redis+cluster://
URL, find it; nothing acknowledged is lost, the killed worker's in-flight jobs are reclaimed and every job ends
exactly once. The same checks as the Sentinel test (tests/support/failover.py); the figures it prints are
the ones in docs/reliability.md."""

from __future__ import annotations

import threading
import time
from datetime import datetime

import pytest
import redis
from redis.exceptions import RedisClusterException

from producer.client import Client
from protocol.keys import Keys
from testbed.redis_cluster import RedisCluster
from tests.support.failover import (
    FIRST_WAVE,
    acknowledged,
    check_nothing_lost,
    first_wave,
    start_worker_pair,
    until,
)

K = Keys("tokenbus")


@pytest.mark.slow
def test_shard_primary_sigkilled_mid_run_nothing_lost(serve_model_dir, worker_process):
    t0 = time.monotonic()
    cluster = RedisCluster(3, replicas=1, node_timeout_ms=1500)
    try:
        # The workers start (torch, the model) while the cluster forms; they wait for it to serve their slot.
        a, b = start_worker_pair(worker_process, cluster.url, serve_model_dir)
        cluster.start()
        for w in (a, b):
            w.wait_for_event("worker_ready", timeout=120)
        client = Client(cluster.url)
        ids, running = first_wave(client, (a, b))

        # A second wave is submitted from the moment of the kill, each call retried until the cluster takes
        # it (SUBMIT_JOB is idempotent by job id): the client's reconnect time.
        late = [{"prompt": f"late {i}", "max_tokens": 2, "ignore_eos": True, "temperature": 0.0} for i in range(4)]
        late_ids = [f"late-{i}" for i in range(4)]
        accepted_at: list[float] = []

        def submit_late() -> None:
            while time.monotonic() - killed_at < 30:
                try:
                    client.submit_many(late, job_ids=late_ids)
                    accepted_at.append(time.monotonic())
                    return
                except (redis.RedisError, RedisClusterException, OSError):
                    time.sleep(0.05)

        old = cluster.port_of_key(K.prefix)
        print(f"\nstart-up to the kill {time.monotonic() - t0:.1f} s")
        killed_at, killed_wall = time.monotonic(), time.time()
        a.kill()
        acked = acknowledged({"worker-a": a, "worker-b": b})  # results a client could read: WAIT 1 returned
        cluster.server(old).kill()
        submitter = threading.Thread(target=submit_late, daemon=True)
        submitter.start()
        new = cluster.wait_promoted(K.prefix, old, 20)
        promoted_s = time.monotonic() - killed_at
        submitter.join(35)
        assert accepted_at, "the client's submits were never accepted after the failover"
        client_s = accepted_at[0] - killed_at
        # Worker B writes again: its first redis_back after the kill (it also logs one at start, having waited
        # for the cluster), or, where redis-py's own retries (a slot-table reload, then the command again) rode
        # out the failover so that no thread saw an error, its first result of a job submitted after the kill.
        def back_after_kill() -> list[float]:
            return [datetime.fromisoformat(e["timestamp"]).timestamp() - killed_wall for e in b.events()
                    if (e.get("event") == "redis_back" or (e.get("event") == "job_finished"
                                                           and e.get("job_id") in late_ids))
                    and datetime.fromisoformat(e["timestamp"]).timestamp() > killed_wall]

        until(back_after_kill, 30, "the worker to write again")
        worker_s = min(back_after_kill())

        all_ids, all_lengths = ids + late_ids, FIRST_WAVE + [2] * len(late_ids)
        _jobs, reclaimed = check_nothing_lost(client, cluster.node(new), K, all_ids, all_lengths, running, b,
                                              "worker-b", acked)
        print(f"\ncluster failover: promoted {promoted_s:.2f} s, client back {client_s:.2f} s, worker back "
              f"{worker_s:.2f} s after SIGKILL; acknowledged before the kill {len(acked)}, in flight "
              f"{len(running)} ({len(reclaimed)} on the killed worker), jobs {len(all_ids)}, lost 0")
        # The promoted replica has no replica of its own left: WAIT 1 times out, logged, results still written.
        b.wait_for_event("results_not_replicated", timeout=5)
        assert promoted_s < 15 and client_s < 20 and worker_s < 30
    finally:
        cluster.cleanup()
