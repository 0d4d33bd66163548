"""Producer throughput: jobs/s for submit() in a loop and submit_many() at several pipeline chunk sizes.

    .venv/bin/python -m benchmarks.queue.submit                 # starts its own redis-server on a free port
    .venv/bin/python -m benchmarks.queue.submit --redis-url redis://host:port/0 --jobs 50000

Prints a table and writes docs/bench_submit.md. Each run uses a fresh namespace (deleted afterwards).
Validation is included in the time: it is part of what a client pays per job.
"""

from __future__ import annotations

import platform
import subprocess
import time
import uuid
from pathlib import Path

from bench.harness import parser, redis_url
from producer import Client
from protocol import scripts

ROOT = Path(__file__).resolve().parents[2]


def requests(n: int) -> list[dict]:
    return [{"prompt": f"Write a haiku about the number {i}.", "max_tokens": 64, "temperature": 0.7, "seed": i}
            for i in range(n)]


def measure(url: str, n: int, chunk: int | None) -> float:
    ns = f"bench-{uuid.uuid4().hex[:8]}"
    c = Client(url, namespace=ns, max_queue_len=0)
    reqs = requests(n)
    t0 = time.perf_counter()
    if chunk is None:
        for r in reqs:
            c.submit(**r)
    else:
        c.submit_many(reqs, chunk_size=chunk)
    elapsed = time.perf_counter() - t0
    assert scripts.queue_depth(c.redis, c.keys) == n
    for key in c.redis.scan_iter(f"*{ns}*", count=10_000):  # {ns}: here, ns: in older trees
        c.redis.unlink(key)
    c.close()
    return n / elapsed


def main() -> None:
    p = parser(__doc__, redis=True)
    p.add_argument("--jobs", type=int, default=20_000)
    p.add_argument("--single", type=int, default=2_000, help="jobs for the one-at-a-time submit() row")
    p.add_argument("--out", default=str(ROOT / "docs" / "bench_submit.md"))
    a = p.parse_args()

    with redis_url(a.redis_url) as url:
        rows = [("submit() one at a time", a.single, measure(url, a.single, None))]
        for chunk in (100, 1000, 5000):
            rows.append((f"submit_many(chunk_size={chunk})", a.jobs, measure(url, a.jobs, chunk)))

    version = subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout.split()
    redis_v = next((v.split("=")[1] for v in version if v.startswith("v=")), "?")
    table = ["| method | jobs | jobs/s |", "|---|---:|---:|"]
    table += [f"| {name} | {n:,} | {rate:,.0f} |" for name, n, rate in rows]
    text = "\n".join([
        "# Producer submit throughput",
        "",
        f"`benchmarks/queue/submit.py`, one Python client, redis-server {redis_v} on localhost "
        f"({'temporary server' if a.redis_url is None else 'the --redis-url server'}), "
        f"{platform.processor() or platform.machine()}, "
        f"Python {platform.python_version()}. Each job: validate (pydantic), then the SUBMIT_JOB Lua script "
        "(idempotency check, queue-length check over every queue, record HSET, stream XADD to its priority's "
        "queue) via EVALSHA; submit_many pipelines "
        "chunk_size scripts per round trip.",
        "",
        *table,
        "",
        "Target: >= 10,000 jobs/s from one client with submit_many.",
        "",
    ])
    print("\n".join(table))
    Path(a.out).write_text(text)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
