"""What priorities cost: submit throughput and the worker's intake work per job, this checkout against another
(the code before priorities), side by side in one run on one redis-server.

    .venv/bin/python -m benchmarks.queue.priorities --base ../prio16-base    # prints the table, writes a section
                                                                     # into docs/benchmarks.md (--no-doc: not)

Each measurement runs in a child process whose `sys.path` starts with the tree it measures, rounds
alternating between the trees; the table gives the median of the rounds. Rows:
- submit: `Client.submit_many` (validation + the SUBMIT_JOB script, pipelined 1,000 a round trip) of
  --jobs loose default jobs, with the default max_queue_len (the script checks the queue depth on every job)
  and with max_queue_len=0 (no check); on this tree also with --batches live batch queues in the registry
  (the depth check reads every queue's XLEN).
- intake: a worker's Redis work per job without the engine, over --intake-jobs queued jobs: read --seats
  entries at a time (`JobQueue.read_new`: XREADGROUP before, the READ script now) and, on its own row,
  START_JOB on each; on this tree also with the jobs spread over --batches batch queues plus interactive
  ones.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BEGIN = "<!-- BEGIN bench_queues -->"
END = "<!-- END bench_queues -->"

CHILD = r"""
import json, sys, time, uuid
sys.path.insert(0, sys.argv[1])
from producer import Client
from protocol.models import Keys
from worker.serve.queue import JobQueue

url, what, n, seats, batches = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
ns = f"bench-{uuid.uuid4().hex[:8]}"
new = hasattr(Keys, "queue")
c = Client(url, namespace=ns, max_queue_len=0 if what == "submit_nolimit" else None)
reqs = [{"prompt": f"Write a haiku about the number {i}.", "max_tokens": 64, "temperature": 0.7, "seed": i}
        for i in range(n)]


def batch_jobs(count, per):
    # live batch queues in the registry, as a deployment with `count` running batches has
    from protocol import scripts
    c.enqueue([scripts.PendingJob(f"b{b}-{i}", json.dumps(reqs[i % n]), f"b{b}", "", "bulk")
               for b in range(count) for i in range(per)])
    return count * per


if what == "submit_batches":
    batch_jobs(batches, 1)
if what.startswith("submit"):
    t0 = time.perf_counter()
    c.submit_many(reqs)
    out = n / (time.perf_counter() - t0)
else:
    if what == "intake_spread":
        total = batch_jobs(batches, n // batches)
        total += len(c.submit_many([r | {"priority": "interactive"} for r in reqs[: n // 10]]))
    else:
        total = len(c.submit_many(reqs))
    q = JobQueue(c.redis, ns, "bench-worker", 600)
    q.ensure_group()
    done, read_s, start_s = 0, 0.0, 0.0
    while done < total:
        t0 = time.perf_counter()
        entries = q.read_new(seats, None)
        t1 = time.perf_counter()
        assert entries, (done, total)
        for e in entries:
            args = (e.queue,) if new else ()
            assert q.start(e.fields["job_id"], e.entry_id, *args)[0] == "running"
        start_s += time.perf_counter() - t1
        read_s += t1 - t0
        done += len(entries)
    out = [read_s / total * 1e6, start_s / total * 1e6]
for key in c.redis.scan_iter(f"*{ns}*", count=10_000):  # {ns}: here, ns: in older trees
    c.redis.unlink(key)
print(json.dumps(out))
"""


def run(tree: Path, url: str, what: str, n: int, seats: int, batches: int) -> list[float]:
    """The child's numbers: [jobs/s] for a submit row, [read µs/job, start µs/job] for an intake row."""
    out = subprocess.run([sys.executable, "-c", CHILD, str(tree), url, what, str(n), str(seats), str(batches)],
                         capture_output=True, text=True, cwd=str(tree))
    if out.returncode != 0:
        raise SystemExit(f"{what} on {tree} failed:\n{out.stderr[-3000:]}")
    value = json.loads(out.stdout.strip().splitlines()[-1])
    return value if isinstance(value, list) else [value]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="a checkout of the code before priorities (same .venv)")
    p.add_argument("--jobs", type=int, default=20_000)
    p.add_argument("--intake-jobs", type=int, default=5_000)
    p.add_argument("--seats", type=int, default=8, help="entries per intake read")
    p.add_argument("--batches", type=int, default=50, help="live batch queues for the spread rows")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-doc", action="store_true")
    a = p.parse_args()
    base, this = Path(a.base).resolve(), ROOT

    from testbed.redis_server import RedisServer

    rows = [  # (label, what, jobs, trees)
        ("submit_many, default max_queue_len (jobs/s)", "submit", a.jobs, (base, this)),
        ("submit_many, max_queue_len=0 (jobs/s)", "submit_nolimit", a.jobs, (base, this)),
        (f"submit_many, {a.batches} live batch queues (jobs/s)", "submit_batches", a.jobs, (this,)),
        (f"intake: read {a.seats} at a time, one queue (µs/job)", "intake", a.intake_jobs, (base, this)),
        (f"intake: read, {a.batches} batch queues + interactive (µs/job)", "intake_spread", a.intake_jobs, (this,)),
    ]
    results: dict[tuple[str, Path], list[float]] = {}
    with RedisServer() as server:
        for _ in range(a.rounds):
            for label, what, n, trees in rows:
                for tree in trees:
                    values = run(tree, server.url, what, n, a.seats, a.batches)
                    results.setdefault((label, tree), []).append(values[0])
                    if len(values) > 1:  # intake: the start script's share on its own row
                        start = label.replace("read", "START_JOB").replace(f" {a.seats} at a time", "")
                        results.setdefault((start, tree), []).append(values[1])
    labels = list(dict.fromkeys(label for label, _tree in results))
    table = ["| measurement | before priorities | with priorities | ratio |", "|---|---:|---:|---:|"]
    for label in labels:
        b = statistics.median(results[(label, base)]) if (label, base) in results else None
        t = statistics.median(results[(label, this)])
        ratio = f"{t / b:.2f}" if b else ""
        fmt = "{:,.0f}" if "jobs/s" in label else "{:,.1f}"
        table.append(f"| {label} | {fmt.format(b) if b else '—'} | {fmt.format(t)} | {ratio} |")
    print("\n".join(table))
    if a.no_doc:
        return
    section = "\n".join([
        BEGIN,
        f"`benchmarks/queue/priorities.py --base <checkout before priorities>`, {time.strftime('%Y-%m-%d')}: one "
        f"redis-server on localhost, one Python client; median of {a.rounds} rounds alternating the two trees "
        f"(2 shared, loaded CPU cores: compare the columns, not other tables). {a.jobs:,} jobs per submit "
        f"row, {a.intake_jobs:,} per intake row, {a.seats} entries per read.",
        "",
        *table,
        END,
    ])
    doc = ROOT / "docs" / "benchmarks.md"
    text = doc.read_text()
    if BEGIN in text:
        head, rest = text.split(BEGIN, 1)
        text = head + section + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n## What priorities cost (submit and intake)\n" + section + "\n"
    doc.write_text(text)
    print(f"wrote {doc}")


if __name__ == "__main__":
    main()
