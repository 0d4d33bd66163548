"""What one job costs Redis: its CPU time, its commands and its memory while queued, phase by phase of a job's
life (submit, intake, finish, read back), for the sizing worked out in docs/deployment.md.

    .venv/bin/python -m benchmarks.queue.redis_cost                 # starts its own redis-server on a free port
    .venv/bin/python -m benchmarks.queue.redis_cost --jobs 50000 --prompt-bytes 2000
    .venv/bin/python -m benchmarks.queue.redis_cost --cluster      # the same on a local 3-shard Redis Cluster
    .venv/bin/python -m benchmarks.queue.redis_cost --compare 3    # + single Redis vs a cluster shard, in turns

The phases run the real code paths with no model: Client.submit_many (SUBMIT_JOB, pipelined), the worker's
JobQueue.read_new + start (READ, START_JOB), one WriteBatch per read with first_token + finish (FIRST_TOKEN,
FINISH_JOB), Client.get_many. Redis CPU is INFO's used_cpu_user + used_cpu_sys around each phase (the
server's own time, so the client's Python and the machine's load barely move it); commands are the sum
over INFO commandstats (calls made inside scripts counted too), of which script calls (EVALSHA/EVAL).
Prints a table and writes docs/bench_redis_cost.md.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from bench.commands import queue_flags
from bench.harness import parser, redis_url
from bench.queue import run

ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def cluster_url() -> Iterator[str]:
    """The URL of a throwaway local 3-shard Redis Cluster."""
    from testbed.redis_cluster import RedisCluster

    cluster = RedisCluster(3).start()
    try:
        yield cluster.url
    finally:
        cluster.cleanup()


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
    p = parser(__doc__, redis=True)
    queue_flags(p)
    p.add_argument("--cluster", action="store_true", help="start a local 3-shard Redis Cluster instead "
                                                          "(figures from the namespace's shard)")
    p.add_argument("--compare", type=int, default=0, metavar="ROUNDS",
                   help="then ROUNDS rounds of a single Redis against a cluster shard, in turns (needs no --redis-url)")
    p.add_argument("--out", default=None, help="default docs/bench_redis_cost.md (--cluster: a file in /tmp)")
    a = p.parse_args()
    # --cluster alone is a check; the cluster figures in docs come from --compare, side by side
    out = a.out or ("/tmp/bench_redis_cost_cluster.md" if a.cluster else str(ROOT / "docs" / "bench_redis_cost.md"))

    with cluster_url() if a.cluster else redis_url(a.redis_url) as url:
        phases = run(url, a.jobs, a.prompt_bytes, a.read_count, a.output_tokens)

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
        f"`python -m benchmarks.queue.redis_cost --jobs {a.jobs} --prompt-bytes {a.prompt_bytes} --output-tokens "
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
