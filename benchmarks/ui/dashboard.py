"""The dashboard's render times with many batches: 1,000 batches of one key (half of them live, each with its own
queue stream), one batch of 1,000,000 jobs, 200 dead letters and 4 workers' heartbeats, in a real redis-server.

    .venv/bin/python -m benchmarks.ui.dashboard [--batches 1000] [--big-batch 1000000] [--runs 30] [--no-write]

Each page is requested in-process (FastAPI's TestClient: the gateway's own code, its Redis round trips and the
template rendering; no network, no browser), `--runs` times after one warm-up; the table gives the median and
p95. The target of issue #26: the overview under 300 ms with 1,000 batches. Writes docs/ui/benchmark.md.
"""

from __future__ import annotations

import json
import re
import statistics
import tempfile
import time
import uuid

from bench.harness import cpu_name, parser
from benchmarks.harness.docs import write_section

KEY = "sk-bench-" + "k" * 24


def populate(r, n_batches: int, big: int) -> str:
    from gateway.batches.records import GatewayBatch
    from gateway.keys import GatewayKeys
    from gateway.settings import owner_id
    from protocol.keys import Keys

    keys, gkeys, who, now = Keys(), GatewayKeys("tokenbus"), owner_id(KEY), time.time()
    pipe = r.pipeline(transaction=False)
    for i in range(n_batches):
        bid = f"batch_{uuid.uuid4().hex}"
        live = i % 2 == 0
        gw = GatewayBatch(id=bid, owner=who, input_file_id="file-x", endpoint="/v1/chat/completions",
                          completion_window="24h", created_at=now - i, expires_at=now + 86400, total=100,
                          in_progress_at=now - i, submitted_at=now - i)
        pipe.hset(gkeys.batch(bid), mapping=gw.fields()).zadd(gkeys.batches(who), {bid: now - i})
        pipe.hset(keys.batch(bid), mapping={"id": bid, "status": "in_progress" if live else "completed",
                                            "endpoint": "/v1/chat/completions", "total": 100,
                                            "finished": 40 if live else 100, "created_at": now - i,
                                            "in_progress_at": now - i})
        if live:  # a live batch has its own queue stream in the priority's registry
            queue = keys.queue("bulk", bid)
            pipe.xadd(queue, {"job_id": f"{bid}-0", "request": "{}"}).zadd(keys.registry("bulk"), {queue: now - i})
    pipe.execute()
    big_id = f"batch_{uuid.uuid4().hex}"
    gw = GatewayBatch(id=big_id, owner=who, input_file_id="file-y", endpoint="/v1/chat/completions",
                      completion_window="24h", created_at=now + 1, expires_at=now + 86400, total=big,
                      in_progress_at=now - 600, submitted_at=now - 600)
    r.hset(gkeys.batch(big_id), mapping=gw.fields())
    r.zadd(gkeys.batches(who), {big_id: now + 1})
    r.hset(keys.batch(big_id), mapping={"id": big_id, "status": "in_progress", "endpoint": "/v1/chat/completions",
                                        "total": big, "finished": big // 3, "failed": 17, "created_at": now - 600,
                                        "in_progress_at": now - 600})
    for start in range(0, big, 50_000):
        r.rpush(keys.batch_jobs(big_id), *(f"{big_id}-{j}" for j in range(start, min(big, start + 50_000))))
    pipe = r.pipeline(transaction=False)
    for j in range(30):  # the first page's job records
        pipe.hset(keys.job(f"{big_id}-{j}"), mapping={"id": f"{big_id}-{j}", "status": "finished",
                                                      "batch_id": big_id, "custom_id": f"line-{j}"})
    for i in range(200):
        pipe.xadd(keys.dead, {"job_id": f"dead-{i}", "reason": "no job record", "attempts": 0,
                              "request": json.dumps({"prompt": "x" * 200}), "worker": "w", "at": now})
    for w in range(4):
        beat = {"name": f"w{w}", "model": "smollm2-135m", "last_seen": now, "running": 8, "waiting": 3,
                "free_blocks": 100, "used_blocks": 28, "jobs_done": 1000, "model_path": "native",
                "backend": "cpu-cpp", "device": "cpu",
                "generated_tokens": 50_000, "step_ms": [12.5] * 32}
        pipe.set(keys.worker(f"w{w}"), json.dumps(beat), ex=600).sadd(keys.workers, f"w{w}")
    pipe.execute()
    return big_id


def main() -> None:
    args = parser(__doc__, docs=True, batches=1000, big_batch=1_000_000, runs=30).parse_args()

    from fastapi.testclient import TestClient

    from gateway.app import create_app
    from gateway.settings import GatewaySettings
    from testbed.redis_server import RedisServer

    with RedisServer() as srv, tempfile.TemporaryDirectory() as files:
        r = srv.client(decode_responses=True)
        t0 = time.perf_counter()
        big_id = populate(r, args.batches, args.big_batch)
        print(f"populated in {time.perf_counter() - t0:.1f} s: {args.batches} batches, one of {args.big_batch} jobs")
        app = create_app(GatewaySettings(api_keys=KEY, redis_url=srv.url, files_dir=files))
        with TestClient(app, base_url="http://bench") as client:
            form = client.get("/ui/login").text
            token = re.search(r'name="login_token" value="([^"]+)"', form).group(1)
            client.post("/ui/login", data={"api_key": KEY, "login_token": token})
            last = args.batches // 25
            pages = [("overview", "/ui/"), ("overview fragment (polled)", "/ui/?fragment=1"),
                     ("batches, first page", "/ui/batches"), ("batches, last page", f"/ui/batches?page={last}"),
                     (f"batch of {args.big_batch:,} jobs", f"/ui/batches/{big_id}"),
                     (f"its jobs, page {args.big_batch // 50:,}", f"/ui/batches/{big_id}?page={args.big_batch // 50}"),
                     ("workers", "/ui/workers"), ("dead letters", "/ui/dead"), ("chart series", "/ui/api/series")]
            rows = []
            for name, path in pages:
                assert client.get(path).status_code == 200, path  # warm-up, and a check
                times = []
                for _ in range(args.runs):
                    t = time.perf_counter()
                    client.get(path)
                    times.append((time.perf_counter() - t) * 1000)
                times.sort()
                rows.append((name, statistics.median(times), times[int(0.95 * (len(times) - 1))]))
    table = ["| page | median ms | p95 ms |", "|---|---:|---:|"]
    table += [f"| {name} | {med:.1f} | {p95:.1f} |" for name, med, p95 in rows]
    body = "\n".join([f"{args.batches:,} batches of one key (half live, each with its queue), one batch of "
                      f"{args.big_batch:,} jobs, 200 dead letters, 4 workers; {args.runs} requests per page, "
                      f"in-process. CPU: {cpu_name()}. `python -m benchmarks.ui.dashboard`", "", *table])
    print(body)
    if not args.no_write:
        print("wrote", write_section("ui/benchmark.md", "ui", body))


if __name__ == "__main__":
    main()
