"""Redis going away under a running worker (in-process Server, tiny real Engine, real redis-server)."""

from __future__ import annotations

import time
from collections import Counter

from redis_server import RedisServer

from producer.protocol import GROUP, Keys

K = Keys("tokenbus")


def test_redis_killed_and_restarted_mid_run(serve_engine, serve, make_client):
    with RedisServer(appendonly=True) as srv:
        client = make_client(srv.url)
        ids = client.submit_many([{"prompt": f"outage {i}", "max_tokens": 60, "ignore_eos": True,
                                   "temperature": 0.0} for i in range(12)])
        # few seats and a short lease: jobs are in flight when Redis dies, and the outage outlives the lease
        handle = serve(serve_engine, url=srv.url, max_num_seqs=4, intake_lookahead=0, lease_ms=1000)
        deadline = time.monotonic() + 120
        while sum(j.status == "finished" for j in client.get_many(ids)) < 2:
            assert time.monotonic() < deadline, "no job finished before the outage"
            time.sleep(0.02)
        srv.kill()
        time.sleep(2.5)
        srv.restart()
        jobs = list(client.as_completed(ids, timeout=240))
        assert sorted(j.id for j in jobs) == sorted(ids)
        assert all(j.status == "finished" for j in jobs), [j.status for j in jobs]
        assert all(j.result.usage.completion_tokens == 60 for j in jobs)
        r = srv.client()
        events = Counter(f[b"job_id"].decode() for _id, f in r.xrange(K.events))
        assert events == Counter(ids), "exactly one ending per job: none lost, none twice"
        assert all(j.attempts == 1 for j in jobs), "the worker's own in-flight jobs were never re-run"
        assert r.xlen(K.jobs) == 0 and r.xpending(K.jobs, GROUP)["pending"] == 0
        assert handle.stop() == 0


def test_worker_waits_for_redis_to_come_up(serve_engine, serve, make_client):
    srv = RedisServer()  # port chosen, server not started yet
    try:
        handle = serve(serve_engine, url=srv.url)
        time.sleep(1.0)
        assert handle.thread.is_alive(), "no Redis yet: the worker waits instead of exiting"
        srv.start()
        client = make_client(srv.url)
        job = client.wait(client.submit("late redis", max_tokens=3), timeout=60)
        assert job.status == "finished"
        assert handle.stop() == 0
    finally:
        srv.cleanup()
