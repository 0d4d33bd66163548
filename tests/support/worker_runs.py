"""`python -m worker` as a test's child process: the flags every process test starts it with, and the check
after a worker was killed mid-run and a second one took over (tests/serve/test_serve_process.py,
test_tp_faults.py; the failover tests start theirs the same way, tests/support/failover.py)."""

from __future__ import annotations

from collections import Counter

import redis

from producer.client import Client
from protocol import scripts
from protocol.keys import Keys
from protocol.models import Job

K = Keys("tokenbus")


def worker_args(redis_url: str, model: str, name: str, *extra: str) -> list[str]:
    # PyTorch's CPU kernels: these tests are about the process, and a worker that waited for the C++ build
    # (another test may be holding its lock on a fresh machine) would only make them slower
    return ["--redis-url", redis_url, "--model", model, "--worker-name", name, "--max-num-seqs", "4",
            "--intake-lookahead", "2", "--max-num-batched-tokens", "256", "--kv-cache-gb", "0.05",
            "--heartbeat-s", "0.5", "--cpu-kernels", "false", *extra]


def check_taken_over(client: Client, r: redis.Redis, ids: list[str], lengths: list[int], in_flight: list[Job],
                     survivor: str = "worker-b") -> dict[str, Job]:
    """Every job ends finished with its full length, each exactly once (one event apiece); the jobs that were
    running on the killed worker ran again on `survivor` (attempt 2); no queue holds an entry. Returns the jobs."""
    jobs = {j.id: j for j in client.as_completed(ids, timeout=300)}
    assert all(j.status == "finished" for j in jobs.values()), [j.error for j in jobs.values()]
    assert [jobs[i].result.usage.completion_tokens for i in ids] == lengths
    assert Counter(f[b"job_id"].decode() for _id, f in r.xrange(K.events)) == Counter(ids), "each ended once"
    for j in in_flight:
        assert jobs[j.id].worker == survivor and jobs[j.id].attempts == 2, jobs[j.id]
    assert scripts.queue_totals(r, K) == (0, 0)
    return jobs
