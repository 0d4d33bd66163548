"""Redis going away under a running worker (in-process Server, tiny real Engine, real redis-server)."""

from __future__ import annotations

import time
from collections import Counter

from protocol import scripts
from protocol.keys import Keys
from testbed.redis_server import RedisServer

K = Keys("tokenbus")


def test_redis_killed_and_restarted_mid_run(serve_engine, serve, make_client, monkeypatch):
    # Pace the real engine (>= 20 ms a step) so that, however fast this machine is, the long jobs are
    # still generating when Redis comes back: their leases lapsed meanwhile, and the worker must not
    # mistake its own in-flight entries for a dead worker's.
    real_step = serve_engine.step

    def paced_step():
        time.sleep(0.02)
        return real_step()

    monkeypatch.setattr(serve_engine, "step", paced_step)
    # 5: done before the outage; 40: done during it (the writer keeps them); 150: done after it
    lengths = [5, 5, 40, 40] + [150] * 4
    with RedisServer(appendonly=True) as srv:
        client = make_client(srv.url)
        ids = client.submit_many([{"prompt": f"outage {i}", "max_tokens": n, "ignore_eos": True,
                                   "temperature": 0.0} for i, n in enumerate(lengths)])
        # every job seated at once, intake still polling: it meets the outage too
        handle = serve(serve_engine, url=srv.url, max_num_seqs=8, lease_ms=1000)
        deadline = time.monotonic() + 120
        while sum(j.status == "finished" for j in client.get_many(ids)) < 2:
            assert time.monotonic() < deadline, "the short jobs did not finish"
            time.sleep(0.02)
        srv.kill()  # SIGKILL: no shutdown work; the AOF (fsync always) holds every acknowledged write
        killed_at = time.time()
        # Redis stays down longer than the lease, and until the 40-token jobs have left the engine
        medium = ids[2:4]
        deadline = time.monotonic() + 120
        while time.time() - killed_at < 1.5 or any(i in serve_engine.requests for i in medium):
            assert time.monotonic() < deadline, "the engine stopped generating while Redis was down"
            time.sleep(0.02)
        restarted_at = time.time()
        srv.restart()
        jobs = list(client.as_completed(ids, timeout=240))
        assert sorted(j.id for j in jobs) == sorted(ids)
        assert all(j.status == "finished" for j in jobs), [j.status for j in jobs]
        assert [client.get(i).result.usage.completion_tokens for i in ids] == lengths
        # generated while Redis was away, kept by the writer, written once it was back
        assert all(killed_at < client.get(i).finished_at < restarted_at for i in medium)
        r = srv.client()
        events = Counter(f[b"job_id"].decode() for _id, f in r.xrange(K.events))
        assert events == Counter(ids), "exactly one ending per job: none lost, none twice"
        assert all(j.attempts == 1 for j in jobs), "the worker's own in-flight jobs were never re-run"
        assert scripts.queue_totals(r, K) == (0, 0)
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
