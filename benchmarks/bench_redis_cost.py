"""What one job costs Redis: its CPU time, its commands and its memory while queued, phase by phase of a job's
life (submit, intake, finish, read back), for the sizing worked out in docs/deployment.md.

    .venv/bin/python -m benchmarks.bench_redis_cost                 # starts its own redis-server on a free port
    .venv/bin/python -m benchmarks.bench_redis_cost --jobs 50000 --prompt-bytes 2000
    .venv/bin/python -m benchmarks.bench_redis_cost --cluster      # the same on a local 3-shard Redis Cluster
    .venv/bin/python -m benchmarks.bench_redis_cost --compare 3    # + single Redis vs a cluster shard, in turns

The phases run the real code paths with no model: Client.submit_many (SUBMIT_JOB, pipelined), the worker's
JobQueue.read_new + start (READ, START_JOB), one WriteBatch per read with first_token + finish (FIRST_TOKEN,
FINISH_JOB), Client.get_many. Redis CPU is INFO's used_cpu_user + used_cpu_sys around each phase (the
server's own time, so the client's Python and the machine's load barely move it); commands are the sum
over INFO commandstats (calls made inside scripts counted too), of which script calls (EVALSHA/EVAL).
Prints a table and writes docs/bench_redis_cost.md.
"""

from __future__ import annotations

import argparse
import subprocess
import time
import uuid
from pathlib import Path

import redis

from producer import Client
from protocol.connection import is_cluster, on_shard, redis_from_url
from protocol.keys import Keys
from protocol.models import JobResult
from worker.serve.job_queue import Ending, JobQueue

ROOT = Path(__file__).resolve().parent.parent


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


def whole_life_cpu(phases: list[tuple[str, dict]]) -> float:
    return sum(ph["cpu"] for _, ph in phases)


def compare(rounds: int, n: int, prompt_bytes: int, read_count: int, output_tokens: int) -> list[str]:
    """Whole-life Redis CPU per job on a single Redis and on a cluster shard, alternating in one process."""
    from testbed.redis_cluster import RedisCluster
    from testbed.redis_server import RedisServer

    single, cluster = RedisServer().start(), RedisCluster(3).start()
    rows = []
    try:
        for i in range(rounds):
            pair = {}
            for name, url in (("single", single.url), ("cluster", cluster.url))[:: 1 if i % 2 == 0 else -1]:
                pair[name] = whole_life_cpu(run(url, n, prompt_bytes, read_count, output_tokens)) * 1e6
            rows.append((pair["single"], pair["cluster"]))
            print(f"round {i + 1}: single {pair['single']:.1f} µs, cluster shard {pair['cluster']:.1f} µs")
    finally:
        single.cleanup()
        cluster.cleanup()
    ratios = sorted(c / s for s, c in rows)
    out = ["", "## A single Redis against a cluster shard, side by side", "",
           f"`--compare {rounds}`: {rounds} rounds of {n:,} jobs in one process, the two alternating (first one, then "
           "the other first); Redis CPU µs per job's whole life. On the shard, pipelined scripts go as EVALSHA "
           "like on the single Redis (protocol/cluster.py loads them on the shard first).", "",
           "| round | single Redis | cluster shard | shard / single |", "|---:|---:|---:|---:|"]
    out += [f"| {i + 1} | {s:.1f} | {c:.1f} | {c / s:.2f} |" for i, (s, c) in enumerate(rows)]
    out += ["", f"Median ratio: **{ratios[len(ratios) // 2]:.2f}**.", ""]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="an existing, otherwise idle Redis (default: start a temporary redis-server)")
    p.add_argument("--jobs", type=int, default=20_000)
    p.add_argument("--prompt-bytes", type=int, default=200, help="bytes of each job's prompt")
    p.add_argument("--output-tokens", type=int, default=64, help="tokens (and 4x bytes of text) in each result")
    p.add_argument("--read-count", type=int, default=64, help="entries per READ and endings per result pipeline")
    p.add_argument("--cluster", action="store_true", help="start a local 3-shard Redis Cluster instead "
                                                          "(figures from the namespace's shard)")
    p.add_argument("--compare", type=int, default=0, metavar="ROUNDS",
                   help="then ROUNDS rounds of a single Redis against a cluster shard, in turns (needs no --url)")
    p.add_argument("--out", default=None, help="default docs/bench_redis_cost.md (--cluster: a file in /tmp)")
    a = p.parse_args()
    # --cluster alone is a check; the cluster figures in docs come from --compare, side by side
    out = a.out or ("/tmp/bench_redis_cost_cluster.md" if a.cluster else str(ROOT / "docs" / "bench_redis_cost.md"))

    server = None
    url = a.url
    if a.cluster:
        from testbed.redis_cluster import RedisCluster

        server = RedisCluster(3).start()
        url = server.url
    elif url is None:
        from testbed.redis_server import RedisServer

        server = RedisServer().start()
        url = server.url
    try:
        phases = run(url, a.jobs, a.prompt_bytes, a.read_count, a.output_tokens)
    finally:
        if server is not None:
            server.cleanup()

    total = {k: sum(ph[k] for _, ph in phases) for k in ("cpu", "scripts", "all")}
    table = ["| phase | Redis CPU µs / job | commands / job (inside scripts too) | of which script calls "
             "| Redis bytes / job after it | client wall µs / job |", "|---|---:|---:|---:|---:|---:|"]
    mem = 0.0
    for name, ph in phases:
        mem += ph["mem"]
        table.append(f"| {name} | {ph['cpu'] * 1e6:.1f} | {ph['all']:.2f} | {ph['scripts']:.2f} | {mem:,.0f} "
                     f"| {ph['wall_us']:.0f} |")
    table.append(f"| **whole life** | **{total['cpu'] * 1e6:.1f}** | **{total['all']:.2f}** "
                 f"| **{total['scripts']:.2f}** | | |")
    per_core = 1 / total["cpu"] if total["cpu"] else float("inf")
    version = subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout.split()
    redis_v = next((w.split("=", 1)[1] for w in version if w.startswith("v=")), "?")
    text = "\n".join([
        "# What one job costs Redis",
        "",
        f"`python -m benchmarks.bench_redis_cost --jobs {a.jobs} --prompt-bytes {a.prompt_bytes} --output-tokens "
        f"{a.output_tokens} --read-count {a.read_count}{' --cluster' if a.cluster else ''}`, "
        f"{time.strftime('%Y-%m-%d')}, redis-server {redis_v} on localhost ("
        + ("a 3-shard Redis Cluster, figures from the namespace's shard; " if a.cluster else "")
        + "one core, no persistence), one Python client and one simulated worker (the real JobQueue "
        "code, no model). Redis CPU is the server's own user + sys time (INFO) over each phase, divided by the "
        "jobs; it hardly depends on the client or on the machine's load, unlike the wall time.",
        "",
        *table,
        "",
        f"One Redis core at 100 % would carry about **{per_core:,.0f} jobs/s** of whole lives like these; plan "
        "for half that (headroom for the heartbeats, lease renewals, the gateway's reads and bursts). The "
        "`bytes after it` column is Redis's used_memory growth per job: after submit it is what a queued job "
        "holds (its request included), after finish what an ended job holds until its result_ttl.",
        "",
    ])
    if a.compare:
        text += "\n".join(compare(a.compare, a.jobs, a.prompt_bytes, a.read_count, a.output_tokens))
    print("\n".join(table))
    print(f"\none core: ~{per_core:,.0f} jobs/s")
    Path(out).write_text(text)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
