"""Issue #22, fairness: the n - 1 choices of an n > 1 job that wait to fork take seats in intake's budget.
Before, the room intake read for ignored them, so a worker with 8 seats took 8 jobs of n = 4: 32 sequences."""

from __future__ import annotations

import threading
import time

from producer import Client

SEATS, N = 8, 4


def sequences(engine) -> int:
    s = engine.scheduler
    return len(s.running) + len(s.waiting) + sum(len(f) for f in engine.forks.values())


def test_n_gt_1_jobs_take_n_seats_in_intakes_budget(serve_engine, serve, redis_server):
    client = Client(redis_server.url)
    handle = serve(serve_engine, max_num_seqs=SEATS, intake_lookahead=0)
    params = {"max_tokens": 6, "ignore_eos": True, "temperature": 1.0, "seed": 1, "n": N}
    first = client.submit(prompt="warm up", **params)  # intake learns that jobs here have n = 4
    client.wait(first, timeout=120)
    peak, stop = [0], threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], sequences(serve_engine))
            time.sleep(0.0005)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    ids = client.submit_many([{"prompt": f"job {i}", **params} for i in range(12)])
    jobs = list(client.as_completed(ids, timeout=300))
    stop.set()
    watcher.join(5)
    assert all(j.status == "finished" and len(j.result.choices) == N for j in jobs)
    # at most one job's n - 1 over the seats (a read is sized before its jobs' n is known); was 4 x the seats
    assert SEATS <= peak[0] <= SEATS + N - 1, peak[0]
    assert handle.stop() == 0
