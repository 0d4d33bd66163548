"""What one job costs Redis, phase by phase of its life, with no model: submit (Client.submit_many: SUBMIT_JOB
pipelined), intake (the worker's JobQueue.read_new + start: READ, START_JOB), finish (one WriteBatch per read
with first_token + finish: FIRST_TOKEN, FINISH_JOB) and read back (Client.get_many). Per job: Redis CPU (INFO's
used_cpu_user + used_cpu_sys around the phase: the server's own time, which the client and the machine's load
barely move), commands (INFO commandstats, calls inside scripts counted), script calls, memory, and the client's
wall time. What `tokenbus bench queue` runs, and benchmarks/queue/redis_cost.py (docs/bench_redis_cost.md)."""

from __future__ import annotations

import time
import uuid

import redis

from producer import Client
from protocol.connection import is_cluster, on_shard, redis_from_url
from protocol.keys import Keys
from protocol.models import JobResult
from worker.serve.job_queue import Ending, JobQueue


def snapshot(r: redis.Redis) -> dict[str, float]:
    info = r.info()
    stats = r.info("commandstats")
    return {"cpu": float(info["used_cpu_user"]) + float(info["used_cpu_sys"]),
            "scripts": float(sum(int(v["calls"]) for k, v in stats.items()
                                 if k.removeprefix("cmdstat_") in ("evalsha", "eval"))),
            "all": float(sum(int(v["calls"]) for v in stats.values())),
            "mem": float(info["used_memory"])}


def run(url: str, n: int, prompt_bytes: int, read_count: int, output_tokens: int) -> list[tuple[str, dict]]:
    ns = f"cost-{uuid.uuid4().hex[:8]}"
    client = Client(url, namespace=ns, max_queue_len=0)
    # INFO of the one server that holds the namespace (on a cluster: the shard owning its hash tag)
    r = client.redis
    if is_cluster(r):
        node = on_shard(r, Keys(ns).routing_key)["target_nodes"]
        r = redis.Redis(host=node.host, port=node.port, decode_responses=True)
    prompt = "x" * prompt_bytes
    reqs = [{"prompt": prompt, "max_tokens": output_tokens, "temperature": 0.0} for _ in range(n)]
    jobs = JobQueue(redis_from_url(url, decode_responses=True), ns, "cost-worker", 3600)
    jobs.ensure_group()
    result = JobResult(text="y" * (4 * output_tokens), token_ids=list(range(output_tokens)), finish_reason="length",
                       model="bench")
    phases: list[tuple[str, dict]] = []

    def phase(name: str, fn) -> None:
        before, t0 = snapshot(r), time.perf_counter()
        fn()
        wall, after = time.perf_counter() - t0, snapshot(r)
        phases.append((name, {k: (after[k] - before[k]) / n for k in before} | {"wall_us": wall / n * 1e6}))

    ids: list[str] = []
    phase("submit (SUBMIT_JOB, pipelined by 1,000)", lambda: ids.extend(client.submit_many(reqs, chunk_size=1000)))
    held: list = []

    def intake() -> None:
        while entries := jobs.read_new(read_count, None):
            for e in entries:
                status, _ = jobs.start(e.fields["job_id"], e.entry_id, e.queue)
                assert status == "running", status
                held.append(e)

    phase(f"intake (READ of {read_count}, START_JOB each)", intake)
    assert len(held) == n, (len(held), n)

    def finish() -> None:
        for i in range(0, n, read_count):
            batch = jobs.write_batch()
            for e in held[i:i + read_count]:
                batch.first_token(e.fields["job_id"], time.time())
                batch.finish(Ending(e.fields["job_id"], e.entry_id, "finished", result=result,
                                    finished_at=time.time(), queue=e.queue))
            batch.execute()

    phase(f"finish (FIRST_TOKEN + FINISH_JOB, {read_count} per round trip)", finish)
    phase("read back (Client.get_many)", lambda: [client.get_many(ids[i:i + 1000]) for i in range(0, n, 1000)])
    for key in r.scan_iter(f"*{ns}*", count=10_000):
        r.unlink(key)
    client.close()
    return phases
