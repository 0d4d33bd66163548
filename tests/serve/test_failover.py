"""Redis high availability: a real worker and a client on a redis+sentinel:// URL ride out the loss of the
primary (SIGKILL mid-run; one replica, three sentinels on loopback). Nothing acknowledged is lost, nothing in
flight is lost, every job ends exactly once, and both processes find the promoted replica within seconds.
The figures this prints are the ones in docs/reliability.md."""

from __future__ import annotations

import time

import pytest

from producer.client import Client
from protocol.keys import Keys
from testbed.polling import until as _until
from testbed.sentinel import Primary, Replica, SentinelGroup, replica_online
from tests.support.failover import FIRST_WAVE, check_nothing_lost, finished, first_wave, start_worker_pair
from worker.serve.job_queue import Ending, JobQueue

K = Keys("tokenbus")


def test_results_wait_for_replicas_and_a_short_wait_is_counted():
    """WAIT after the result pipeline: with the replica up it returns 1; asking for 2 of 1 times out, the
    result is still written, and the shortfall is counted (and logged as results_not_replicated)."""
    primary = Primary().start()
    replica = Replica(primary.port).start()
    try:
        r = primary.client(decode_responses=True)
        _until(lambda: replica_online(primary), 10, "the replica")
        ids = Client(redis_client=r).submit_many([{"prompt": "a"}, {"prompt": "b"}])
        for job_id, wanted in zip(ids, (1, 2), strict=True):
            # a generous WAIT when it can be met (it returns as soon as the replica acks), a short one when not
            jobs = JobQueue(r, "tokenbus", "w", 60, min_replicas=wanted, wait_ms=5000 if wanted == 1 else 100)
            batch = jobs.write_batch()
            at = batch.finish(Ending(job_id, "", "failed", error="x", error_code="test", finished_at=1.0))
            replies = batch.execute()
            assert len(replies) == 1 and replies[at] == 1
            assert jobs.replicas_short == wanted - 1
            # acknowledged: the replica has it the moment execute() returns (WAIT 1 made sure)
            assert replica.client(decode_responses=True).hget(K.job(job_id), "status") == "failed"
    finally:
        replica.cleanup()
        primary.cleanup()


@pytest.mark.slow
def test_primary_sigkilled_mid_run_nothing_lost(serve_model_dir, worker_process):
    """Two workers; the primary and worker A are SIGKILLed together. B and the client find the promoted replica;
    the jobs B ran go on under its leases (replicated), A's are reclaimed by B from the replica."""
    t0 = time.monotonic()
    with SentinelGroup(down_after_ms=500, failover_timeout_ms=5000) as g:
        # The workers start (torch, the model) while the sentinels find each other; they wait for their Redis.
        a, b = start_worker_pair(worker_process, g.url, serve_model_dir)
        g.wait_ready()
        for w in (a, b):  # both serving, so the jobs are shared between them
            w.wait_for_event("worker_ready", timeout=120)
        client = Client(g.url)
        ids, running = first_wave(client, (a, b))
        # Acknowledged: a worker logs job_finished only after its pipeline, WAIT 1 included, returned.
        acked = {e["job_id"] for e in finished((a, b))}

        print(f"\nstart-up to the kill {time.monotonic() - t0:.1f} s")
        killed_at = time.monotonic()
        a.kill()
        g.primary.kill()
        g.wait_promoted(15)
        promoted_s = time.monotonic() - killed_at

        # The client: its next call goes through the sentinels to the promoted replica.
        client_s = _until(lambda: client.get_many(ids) is not None, 15, "the client to reconnect") - killed_at
        # Worker B: its first write after the kill lands on the promoted replica.
        worker_s = _until(lambda: any(e.get("event") == "redis_back" for e in b.events()), 30,
                          "the worker to reconnect") - killed_at

        # Every job finished (none lost); B's own in-flight jobs kept their leases, A's were reclaimed by B from
        # the promoted replica; each ended once there.
        _jobs, reclaimed = check_nothing_lost(client, g.replica.client(decode_responses=True), K, ids, FIRST_WAVE,
                                              running, b, "worker-b")
        print(f"\nfailover: promoted {promoted_s:.2f} s, client back {client_s:.2f} s, worker back "
              f"{worker_s:.2f} s after SIGKILL; acknowledged before the kill {len(acked)}, in flight "
              f"{len(running)} ({len(reclaimed)} on the killed worker), jobs {len(ids)}, lost 0")
        # With no replica left, WAIT 1 times out: logged, and the results are still written.
        b.wait_for_event("results_not_replicated", timeout=5)
        assert promoted_s < 10 and client_s < 15 and worker_s < 30
