"""What each queue operation costs per job with 1, 100 and 1,000 live batches and 1,000 or 1,000,000 queued jobs,
on a private redis-server: the costs should be flat (docs/scaling.md, with a plot).

    .venv/bin/python -m benchmarks.queue.scaling            # the full grid; writes docs/scaling.md + png
    .venv/bin/python -m benchmarks.queue.scaling --quick    # 1 and 100 batches, 1,000 and 20,000 jobs; no doc

For each queued count the namespace is filled once with that many jobs in one live batch, then live batches of
10 jobs each are added up to each batch count (batch records and queues, written with the SUBMIT_JOB script
pipelined 2,000 a round trip: no validation). In each state every operation runs --reps times on --ops fresh
jobs, timed per job (the fastest round is kept: the machine is shared):
- submit: `Client.submit_many` of loose jobs (validation, SUBMIT_JOB with its max_queue_len check);
- intake: the worker's `JobQueue.read_new` (READ, 64 seats a call) and START_JOB on each entry;
- finish: FINISH_JOB on those jobs (the worker's ending, pipelined as its completion writer does);
- cancel: `Client.cancel_batch` of a batch of --ops queued jobs;
- finalisation: FINISH_JOB of --ops one-job batches: every finish ends its batch (counters, registry, queue);
- as_completed: `Client.as_completed` over --ops ended jobs;
- info: one `Client.info()` (per call, not per job);
- and, as the reference, the old depth check: XLEN summed over every queue (`scripts.queue_totals`, per call),
  which the submit script ran for every job before the depth counter.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
import uuid

from bench.harness import parser
from benchmarks.harness.docs import DOCS, write_section

NS = "scale"
REQUEST = json.dumps({"prompt": "x", "max_tokens": 1})
EXTRA_PER_BATCH = 10  # queued jobs in each live batch beyond the first (which holds the state's queued jobs)
OPS = ["submit", "intake", "finish", "cancel", "finalisation", "as_completed"]


def fill(r, keys, first: int, batches: int, per: int) -> None:
    """Live batches live{first} .. live{first + batches - 1} of `per` queued jobs each (records in_progress, queues
    in their registry), written with SUBMIT_JOB pipelined 2,000 a round trip."""
    from protocol import scripts

    submit = scripts.script(scripts.SUBMIT_JOB)
    now = time.time()
    pipe = r.pipeline(transaction=False)
    pending = 0
    for b in range(first, first + batches):
        bid = f"live{b}"
        pipe.hset(keys.batch(bid), mapping={"id": bid, "status": "in_progress", "endpoint": "/v1/completions",
                                            "total": per, "finished": 0, "failed": 0, "cancelled": 0,
                                            "created_at": now, "priority": "bulk", "queue": keys.queue("bulk", bid)})
        for i in range(per):
            k, a = scripts.submit_args(keys, scripts.PendingJob(f"{bid}-{i}", REQUEST, bid, "", "bulk"), now, 0, 3600)
            submit(keys=k, args=a, client=pipe)
            pending += 1
            if pending >= 2_000:
                pipe.execute()
                pending = 0
    pipe.execute()


def measure(c, ops: int, rep: str) -> dict[str, float]:
    """µs per job of each operation (info and the old depth check: µs per call) in the current state."""
    from protocol import scripts
    from worker.serve.job_queue import Ending, JobQueue

    out: dict[str, float] = {}
    worker = JobQueue(c.redis, NS, "bench-worker", 3600)
    worker.ensure_group()

    t = time.perf_counter()
    ids = c.submit_many([{"prompt": f"s{i}", "max_tokens": 1, "priority": "interactive"} for i in range(ops)])
    assert len(ids) == ops
    out["submit"] = (time.perf_counter() - t) / ops * 1e6

    # intake: the interactive jobs just submitted come first, then the batches' jobs in turn
    t = time.perf_counter()
    got = []
    while len(got) < ops:
        entries = worker.read_new(min(64, ops - len(got)), None)
        for e in entries:
            worker.start(e.fields["job_id"], e.entry_id, e.queue)
        got += entries
    out["intake"] = (time.perf_counter() - t) / ops * 1e6

    t = time.perf_counter()
    for start in range(0, ops, 64):
        batch = worker.write_batch()
        for e in got[start:start + 64]:
            batch.finish(Ending(e.fields["job_id"], e.entry_id, "finished", queue=e.queue))
        batch.execute()
    out["finish"] = (time.perf_counter() - t) / ops * 1e6

    t = time.perf_counter()
    done = sum(1 for _ in c.as_completed(ids, timeout=60))
    out["as_completed"] = (time.perf_counter() - t) / ops * 1e6
    assert done == ops

    lines = [json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"prompt": "c"}}) for i in range(ops)]
    c.submit_batch(lines, batch_id=f"to-cancel-{rep}")
    t = time.perf_counter()
    rec = c.cancel_batch(f"to-cancel-{rep}")
    out["cancel"] = (time.perf_counter() - t) / ops * 1e6
    assert rec.status == "cancelled", rec.status

    # one-job batches: each finish ends its batch
    now = time.time()
    pipe = c.redis.pipeline(transaction=False)
    submit = scripts.script(scripts.SUBMIT_JOB)
    for i in range(ops):
        bid = f"one{rep}x{i}"
        pipe.hset(c.keys.batch(bid), mapping={"id": bid, "status": "in_progress", "endpoint": "/v1/completions",
                                              "total": 1, "finished": 0, "failed": 0, "cancelled": 0,
                                              "created_at": now, "priority": "bulk",
                                              "queue": c.keys.queue("bulk", bid)})
        k, a = scripts.submit_args(c.keys, scripts.PendingJob(f"{bid}-0", REQUEST, bid, "", "bulk"), now, 0, 3600)
        submit(keys=k, args=a, client=pipe)
    entries = [e for i, e in enumerate(pipe.execute()) if i % 2 == 1]
    t = time.perf_counter()
    pipe = c.redis.pipeline(transaction=False)
    for i, (_code, entry) in enumerate(entries):
        bid = f"one{rep}x{i}"
        scripts.finish_job(pipe, c.keys, f"{bid}-0", "finished", entry_id=entry, queue=c.keys.queue("bulk", bid))
    assert all(x == 1 for x in pipe.execute())
    out["finalisation"] = (time.perf_counter() - t) / ops * 1e6
    assert c.redis.hget(c.keys.batch(f"one{rep}x0"), "status") == "completed"

    out["info"] = min(_timed(c.info) for _ in range(5)) * 1e6
    out["old depth check"] = min(_timed(lambda: scripts.queue_totals(c.redis, c.keys)) for _ in range(5)) * 1e6
    depth = scripts.depth(c.redis, c.keys)
    recount = scripts.queue_totals(c.redis, c.keys)
    assert (depth.total, depth.pending) == recount, f"counter {depth} != recount {recount}"
    out["depth"] = depth.total
    return out


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def plot(results: dict[tuple[int, int], dict[str, float]], batch_counts, queued_counts, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(queued_counts), figsize=(6 * len(queued_counts), 4.2), sharey=True)
    for ax, q in zip(axes if len(queued_counts) > 1 else [axes], queued_counts, strict=True):
        for op in [*OPS, "info", "old depth check"]:
            ys = [results[(b, q)][op] for b in batch_counts]
            style = "--" if op in ("info", "old depth check") else "-"
            ax.plot(batch_counts, ys, style, marker="o", label=op + (" (per call)" if style == "--" else ""))
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("live batches")
        ax.set_title(f"{q:,} queued jobs")
        ax.grid(True, which="both", alpha=0.3)
    (axes[0] if len(queued_counts) > 1 else axes).set_ylabel("µs per job (dashed: per call)")
    (axes[-1] if len(queued_counts) > 1 else axes).legend(fontsize=8)
    fig.suptitle("tokenbus queue operations: cost per job vs live batches and queued jobs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report(results, batch_counts, queued_counts, ops: int) -> str:
    head = "| operation | " + " | ".join(f"{b:,} b / {q:,} q" for q in queued_counts for b in batch_counts)
    head += " | max / min |"
    lines = [head, "|---" * (2 + len(batch_counts) * len(queued_counts)) + "|"]
    for op in [*OPS, "info", "old depth check"]:
        vals = [results[(b, q)][op] for q in queued_counts for b in batch_counts]
        unit = " (µs per call)" if op in ("info", "old depth check") else ""
        lines.append(f"| {op}{unit} | " + " | ".join(f"{v:,.0f}" for v in vals)
                     + f" | {max(vals) / min(vals):.1f}x |")
    fills = ", ".join(f"{q:,} jobs {max(results[(b, q)]['fill_s'] for b in batch_counts):.0f} s" for q in queued_counts)
    return "\n".join(lines) + f"\n\nµs per job unless marked (the fastest of the rounds); {ops:,} jobs per " \
        f"operation; b = live batches, q = queued jobs (in the first batch; every other batch holds " \
        f"{EXTRA_PER_BATCH}). Filling (SUBMIT_JOB pipelined 2,000 a round trip, all batches): {fills}."


def main() -> None:
    ap = parser(__doc__, docs=True)
    ap.add_argument("--batches", default="1,100,1000", help="live batch counts, comma-separated")
    ap.add_argument("--queued", default="1000,1000000", help="queued job counts, comma-separated")
    ap.add_argument("--ops", type=int, default=1000, help="jobs per measured operation")
    ap.add_argument("--reps", type=int, default=3, help="rounds per state; the table keeps each one's fastest")
    ap.add_argument("--quick", action="store_true", help="1 and 100 batches, 1,000 and 20,000 jobs, 200 ops; "
                                                              "no doc (a smoke run)")
    args = ap.parse_args()
    if args.quick:
        args.batches, args.queued, args.ops, args.no_write = "1,100", "1000,20000", 200, True
    batch_counts = [int(x) for x in args.batches.split(",")]
    queued_counts = [int(x) for x in args.queued.split(",")]

    from producer import Client
    from protocol.connection import redis_from_url
    from testbed.redis_server import RedisServer

    results: dict[tuple[int, int], dict[str, float]] = {}
    with RedisServer() as server:
        # a long socket timeout: the machine is shared, and the old depth check over 1,000 queues is slow
        r = redis_from_url(server.url, decode_responses=True, encoding_errors="replace", socket_timeout=600)
        c = Client(server.url, namespace=NS, max_queue_len=100_000_000, result_ttl=3600, redis_client=r)
        for q in queued_counts:
            c.redis.flushall()
            t = time.perf_counter()
            fill(c.redis, c.keys, 0, 1, q)  # the queued jobs, in the first batch
            fill_s, have = time.perf_counter() - t, 1
            for b in sorted(batch_counts):
                t = time.perf_counter()
                fill(c.redis, c.keys, have, b - have, EXTRA_PER_BATCH)  # and more live batches beside it
                fill_s, have = fill_s + time.perf_counter() - t, b
                print(f"{q:,} queued jobs, {b:,} live batches (filled in {fill_s:.0f} s) ...", flush=True)
                reps = [measure(c, args.ops, uuid.uuid4().hex[:8]) for _ in range(args.reps)]
                results[(b, q)] = {k: min(r[k] for r in reps) for k in reps[0]} | {"fill_s": fill_s}
                print("  " + "  ".join(f"{k} {v:,.0f}" for k, v in results[(b, q)].items()), flush=True)
        c.close()
    body = report(results, batch_counts, queued_counts, args.ops)
    print(body)
    flat = max(statistics.mean(results[(b, q)][op] for op in OPS) for b in batch_counts for q in queued_counts)
    print(f"largest mean of the per-job operations: {flat:,.0f} µs")
    if not args.no_write:
        png = os.path.join(DOCS, "scaling.png")
        plot(results, batch_counts, queued_counts, png)
        section = ("### Cost per job vs live batches and queued jobs (`benchmarks/queue/scaling.py`)\n\n"
                   f"{os.cpu_count()} CPU cores shared with other work, Python {platform.python_version()}, "
                   "one private redis-server.\n\n" + body + "\n\n![cost per operation](scaling.png)")
        print("wrote", write_section("scaling.md", "bench_scaling", section), png)


if __name__ == "__main__":
    main()
