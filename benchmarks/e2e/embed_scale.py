"""A big /v1/embeddings batch through a real gateway (issue 35's scale check): upload, ingest, embed, export.

Stands up redis-server, a worker on all-MiniLM-L6-v2, `tokenbus-gateway serve` and its task process, then sends a
file of --lines /v1/embeddings lines (--inputs-per-line inputs each) through the openai SDK: files.create,
batches.create, wait, files.content streamed to disk. Reports, while it runs:
    RSS       the most the gateway's and the task process's trees (RQ's work horses included) held, sampled
    ingest    lines/s: the upload (lines validated as they stream in), then the submit (every job written)
    Redis     used_memory before, at its peak, once every job ended, and per job; the vectors' own bytes
Targets: gateway and task RSS <= 300 MB, ingest >= 20,000 lines/s.

    .venv/bin/python -m benchmarks.e2e.embed_scale --lines 500000           # the check (the lead runs it)
    .venv/bin/python -m benchmarks.e2e.embed_scale --lines 5000 --no-write  # a smoke run
Writes docs/embeddings.md, section "embeddings-scale", unless --no-write.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from pathlib import Path

from bench.harness import load_average, machine, markdown_table, parser, write_json
from benchmarks.harness.docs import publish
from testbed.gateway_procs import KEYS, Deployment, Proc, healthy, wait_until
from testbed.redis_server import RedisServer, free_port

MODEL = "all-minilm-l6-v2"


TICK = os.sysconf("SC_CLK_TCK")


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and its descendants (Linux /proc)."""
    return _tree(pid)[0]


def tree_cpu(pid: int) -> float:
    """CPU seconds a process and its descendants used, those reaped included (RQ forks a work horse per task)."""
    return _tree(pid)[1]


def _tree(pid: int) -> tuple[int, float]:
    rss, ticks, todo = 0, 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                rss += next(int(x.split()[1]) * 1024 for x in f if x.startswith("VmRSS:"))
            with open(f"/proc/{p}/stat") as f:  # utime stime cutime cstime: fields 14-17, after the ")"
                ticks += sum(int(x) for x in f.read().rsplit(")", 1)[1].split()[11:15])
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except (OSError, StopIteration):
            continue
    return rss, ticks / TICK


def redis_cpu(r) -> float:
    info = r.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


class Sampler(threading.Thread):
    """The peak RSS of each named process tree and Redis's peak used_memory, every 0.2 s."""

    def __init__(self, procs: dict[str, Proc], redis) -> None:
        super().__init__(daemon=True)
        self.procs, self.redis = procs, redis
        self.peak = {name: 0 for name in procs}
        self.redis_peak = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.2):
            for name, p in self.procs.items():
                self.peak[name] = max(self.peak[name], tree_rss(p.proc.pid))
            self.redis_peak = max(self.redis_peak, int(self.redis.info("memory")["used_memory"]))


def write_file(path: Path, lines: int, per_line: int) -> None:
    with path.open("w") as f:
        for i in range(lines):
            texts = [f"line {i} input {j}: the quick brown fox jumps over the lazy dog" for j in range(per_line)]
            body = {"model": MODEL, "input": texts if per_line > 1 else texts[0]}
            f.write(json.dumps({"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings", "body": body}) + "\n")


def start(tmp: Path, lines: int, per_line: int) -> Deployment:
    srv = RedisServer().start()
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENBUS_REDIS_URL=srv.url, HF_HUB_OFFLINE="1",
               TOKENBUS_DEVICE="cpu", TOKENBUS_GATEWAY_API_KEYS=KEYS["alice"], TOKENBUS_GATEWAY_PORT=str(port),
               TOKENBUS_GATEWAY_FILES_DIR=str(tmp / "files"), TOKENBUS_GATEWAY_WATCH_INTERVAL_S="0.5",
               TOKENBUS_GATEWAY_MAX_REQUESTS_PER_FILE=str(max(lines, 50_000)),
               TOKENBUS_GATEWAY_MAX_UPLOAD_BYTES=str(4 << 30),
               TOKENBUS_GATEWAY_MAX_QUEUED_REQUESTS_PER_KEY=str(max(lines, 200_000)),
               # every vector is reserved at 1,024 floats (producer.batch_file.EMBED_RESERVE_WIDTH)
               TOKENBUS_GATEWAY_MAX_QUEUED_BYTES_PER_KEY=str(64 << 30),
               TOKENBUS_GATEWAY_MAX_QUEUED_BYTES=str(64 << 30))
    dep = Deployment(redis=srv, base_url=f"http://127.0.0.1:{port}", timeout=600)
    dep.procs["worker"] = Proc("worker", ["-m", "worker", "--model", MODEL, "--worker-name", "scale-worker",
                                          "--max-num-seqs", "128", "--max-num-batched-tokens", "4096",
                                          "--heartbeat-s", "1", "--log-level", "warning"], env, tmp)
    dep.procs["gateway"] = Proc("gateway", ["-m", "gateway", "serve"], env, tmp)
    dep.procs["tasks"] = Proc("tasks", ["-m", "gateway", "tasks"], env, tmp)
    wait_until(lambda: healthy(dep.base_url), 120, "the gateway", dep.all(), every=0.2)
    r = srv.client()
    wait_until(lambda: r.exists("{tokenbus}:worker:scale-worker"), 600, "the worker", dep.all(), every=0.5)
    return dep


def run(lines: int, per_line: int) -> dict[str, float]:
    load_start = load_average()
    tmp = Path(tempfile.mkdtemp(prefix="embed-scale-"))
    src = tmp / "in.jsonl"
    write_file(src, lines, per_line)
    dep = start(tmp, lines, per_line)
    r = dep.redis.client()
    try:
        sampler = Sampler({"gateway": dep.procs["gateway"], "tasks": dep.procs["tasks"]}, r)
        sampler.start()
        before = int(r.info("memory")["used_memory"])
        client = dep.openai("alice")
        gw_pid, tasks_pid = dep.procs["gateway"].proc.pid, dep.procs["tasks"].proc.pid
        # CPU seconds beside wall time: on a shared machine lines per CPU-second is what a quiet core would do
        cpu0 = tree_cpu(gw_pid)
        t0 = time.perf_counter()
        uploaded = client.files.create(file=src.open("rb"), purpose="batch")
        upload_s = time.perf_counter() - t0
        upload_cpu = tree_cpu(gw_pid) - cpu0
        cpu1, redis1 = tree_cpu(tasks_pid) + tree_cpu(gw_pid), redis_cpu(r)
        t1 = time.perf_counter()
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")
        gw_key = f"{{tokenbus}}:gw:batch:{batch.id}"
        wait_until(lambda: r.hget(gw_key, "submitted_at"), 3600, "every job written", dep.all(), every=0.05)
        submit_s = time.perf_counter() - t1
        submit_cpu = tree_cpu(tasks_pid) + tree_cpu(gw_pid) - cpu1  # the worker's own reads count in Redis's
        submit_redis_cpu = redis_cpu(r) - redis1

        def ended():
            b = client.batches.retrieve(batch.id)
            return b if b.status in ("completed", "failed", "cancelled", "expired") else None

        done = wait_until(ended, 24 * 3600, "the batch to end", dep.all(), every=1.0)
        run_s = time.perf_counter() - t1
        after = int(r.info("memory")["used_memory"])
        vector_bytes = sum(r.memory_usage(k) or 0 for k in r.scan_iter("{tokenbus}:job:*:vectors", count=1000))
        out = tmp / "out.jsonl"
        t2 = time.perf_counter()
        with client.files.with_streaming_response.content(done.output_file_id) as resp, out.open("wb") as f:
            for chunk in resp.iter_bytes():
                f.write(chunk)
        download_s = time.perf_counter() - t2
        sampler.stop.set()
        sampler.join()
        exported = sum(1 for _ in out.open("rb"))
        return {"lines": lines, "inputs_per_line": per_line, "load_start": load_start, "status": done.status,
                "output_lines": exported,
                "upload_lines_s": lines / upload_s, "submit_lines_s": lines / submit_s, "run_s": run_s,
                "upload_lines_cpu_s": lines / max(upload_cpu, 1e-9),
                "submit_lines_cpu_s": lines / max(submit_cpu, 1e-9),
                "submit_lines_redis_cpu_s": lines / max(submit_redis_cpu, 1e-9),
                "inputs_s": lines * per_line / run_s, "download_s": download_s,
                "gateway_rss_mb": sampler.peak["gateway"] / 2**20, "tasks_rss_mb": sampler.peak["tasks"] / 2**20,
                "redis_before_mb": before / 2**20, "redis_peak_mb": sampler.redis_peak / 2**20,
                "redis_after_mb": after / 2**20, "redis_bytes_per_job": (after - before) / lines,
                "vector_bytes_per_job": vector_bytes / lines}
    finally:
        for p in dep.procs.values():
            p.stop()
        dep.redis.cleanup()


def report(f: dict) -> str:
    """The docs section's body for one run's figures (--json writes the same dict)."""
    rows = [f"| {f['lines']:,} x {f['inputs_per_line']} | {f['status']}, {f['output_lines']:,} lines | "
            f"{f['upload_lines_s']:,.0f} / {f['submit_lines_s']:,.0f} | {f['upload_lines_cpu_s']:,.0f} / "
            f"{f['submit_lines_cpu_s']:,.0f} (Redis {f['submit_lines_redis_cpu_s']:,.0f}) | {f['inputs_s']:,.0f} | "
            f"{f['gateway_rss_mb']:.0f} / {f['tasks_rss_mb']:.0f} | {f['redis_before_mb']:.0f} / "
            f"{f['redis_peak_mb']:.0f} / {f['redis_after_mb']:.0f} | {f['redis_bytes_per_job']:,.0f} "
            f"({f['vector_bytes_per_job']:,.0f} vectors) |"]
    return "\n".join([f"{MODEL} on the CPU, one worker; {f['machine']} (at the start: {f['load_start']}); "
                      f"{f['when']}.", "",
                      *markdown_table(["lines x inputs", "ended", "ingest lines/s (upload / submit)",
                                       "lines per CPU-second (upload / submit)", "inputs/s",
                                       "RSS MB gateway / tasks", "Redis MB before / peak / ended",
                                       "Redis bytes per job"], rows)])


def main() -> None:
    ap = parser(__doc__, docs=True, lines=500_000, inputs_per_line=1)
    args = ap.parse_args()
    f = run(args.lines, args.inputs_per_line) | {"machine": machine(), "when": time.strftime("%Y-%m-%d %H:%M")}
    write_json(args.json, f)
    publish(report(f), "embeddings.md", "embeddings-scale", not args.no_write)


if __name__ == "__main__":
    main()
