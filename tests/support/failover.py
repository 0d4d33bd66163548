"""What the failover tests (Sentinel: tests/serve/test_failover.py, Redis Cluster:
tests/serve/test_cluster_failover.py) wait for and check once the primary and worker A were SIGKILLed together
and worker B carried on through the promoted replica."""

from __future__ import annotations

from collections import Counter

import redis

from producer.client import Client
from protocol import scripts
from protocol.keys import Keys
from protocol.models import Job
from testbed.polling import until
from tests.support.worker_runs import worker_args

FIRST_WAVE = [2] * 4 + [24] * 8  # max_tokens: four short jobs end before the kill, eight long ones are in flight


def start_worker_pair(worker_process, url: str, model_dir: str) -> tuple:
    """Workers A and B on `url`, results replicated to 1 replica (WAIT 1, 1 s) under 3 s leases; they start
    (torch, the model) while the Redis side forms, and wait for it."""
    return tuple(worker_process(*worker_args(url, model_dir, name, "--lease-ms", "3000", "--redis-min-replicas",
                                             "1", "--redis-wait-ms", "1000"))
                 for name in ("worker-a", "worker-b"))


def first_wave(client: Client, workers) -> tuple[list[str], dict[str, str]]:
    """Submit FIRST_WAVE; once 3 results are in, its ids and the running jobs' workers (both must have some)."""
    ids = client.submit_many([{"prompt": f"failover {i}", "max_tokens": n, "ignore_eos": True,
                               "temperature": 0.0} for i, n in enumerate(FIRST_WAVE)])
    until(lambda: len(finished(workers)) >= 3, 120, "3 results")
    running = {j.id: j.worker for j in client.get_many(ids) if j.status == "running"}
    assert "worker-a" in running.values() and "worker-b" in running.values(), running
    assert not [e for w in workers for e in w.events() if e.get("event") == "results_not_replicated"]
    return ids, running


def finished(workers) -> list[dict]:
    """job_finished events: a worker logs one only after its result pipeline, WAIT included, returned."""
    return [e for w in workers for e in w.events() if e.get("event") == "job_finished"]


def acknowledged(workers: dict[str, object]) -> dict[str, str]:
    """job id -> the worker whose job_finished (after WAIT) says it acknowledged the job's result."""
    return {e["job_id"]: name for name, w in workers.items() for e in finished((w,))}


def check_nothing_lost(client: Client, new_primary: redis.Redis, keys: Keys, ids: list[str], lengths: list[int],
                       running: dict[str, str], survivor, survivor_name: str,
                       acked: dict[str, str] | None = None) -> tuple[dict[str, Job], list[str]]:
    """Every job ends finished with its length; each acknowledged result (acked: id -> worker) is the one kept,
    not run again; the survivor's in-flight jobs kept their leases (attempt 1) and
    the killed worker's were reclaimed by the survivor (attempt 2); every job ended exactly once on the record
    the promoted replica kept (its events stream), and no queue holds an entry. Returns (jobs, reclaimed ids)."""
    jobs = {j.id: j for j in client.as_completed(ids, timeout=120)}
    lost = [i for i in ids if i not in jobs or jobs[i].status != "finished"]
    assert lost == [], [jobs.get(i) for i in lost]
    assert [jobs[i].result.usage.completion_tokens for i in ids] == lengths
    kept = {i: (jobs[i].worker, jobs[i].attempts) for i in acked or {}}
    assert kept == {i: (w, 1) for i, w in (acked or {}).items()}, "an acknowledged result was lost and run again"
    reclaimed = [i for i, w in running.items() if w != survivor_name]
    assert all(jobs[i].worker == survivor_name and jobs[i].attempts == 1 for i, w in running.items()
               if w == survivor_name)
    assert all(jobs[i].worker == survivor_name and jobs[i].attempts == 2 for i in reclaimed)
    assert any(e.get("event") == "entry_reclaimed" for e in survivor.events())
    assert new_primary.info("replication")["role"] == "master"
    events = Counter(f["job_id"] for _id, f in new_primary.xrange(keys.events))
    assert events == Counter(ids), "every job ended exactly once, on the record the replica kept"
    assert scripts.queue_totals(new_primary, keys) == (0, 0)
    return jobs, reclaimed
