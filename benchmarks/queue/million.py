"""A million-line OpenAI batch through both routes, `tokenbus batch submit|export` and the gateway (upload,
POST /v1/batches, its tasks process's submit and finalisation), each against a private redis-server:
lines/s, the peak RSS of every process, and Redis bytes per queued job. Writes docs/bench_million.md + .json.

No worker runs: ingest is measured with the jobs left queued; then every job is ended by FINISH_JOB (the
script a worker ends a job with), pipelined from this process with a fixed one-token result, and the export
(the CLI's, and the gateway's finalisation into its output file) is measured on those.

    python -m benchmarks.queue.million [--lines 1000000] [--quick]
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import redis

from bench.harness import parser
from benchmarks.queue.million_gateway import gateway_route
from benchmarks.queue.million_probe import finish_all, redis_bytes, redis_cpu, step
from producer.submit_pipe import CALL_JOBS, DEPTH
from protocol.keys import Keys
from testbed.redis_server import RedisServer

ROOT = Path(__file__).resolve().parents[2]
OLD_SAMPLE = 50_000  # jobs whose records are given their request back to measure the old layout


def write_file(path: Path, n: int) -> int:
    """n chat lines of ~230 bytes (a short question each, like the issue's 169-byte average and up)."""
    with path.open("w") as f:
        for i in range(n):
            body = {
                "model": "smollm2-135m",
                "max_tokens": 16,
                "temperature": 0.0,
                "messages": [{"role": "user", "content": f"Question {i}: what is {i % 97} times {i % 89}?"}],
            }
            f.write(
                json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})
                + "\n"
            )
    return path.stat().st_size


def run_cli(args: list[str], env: dict[str, str]) -> tuple[float, float, float, str, str]:
    """(seconds, peak RSS MB, CPU seconds, stdout, stderr) of `python -m producer ARGS` (wait4: its rusage)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "producer", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _, status, usage = os.wait4(proc.pid, 0)  # its output is a few lines: the pipes never fill
    secs = time.perf_counter() - t0
    out, err = proc.stdout.read(), proc.stderr.read()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise RuntimeError(f"tokenbus {' '.join(args)} failed ({proc.returncode}):\n{err[-3000:]}")
    return secs, usage.ru_maxrss / 1024, usage.ru_utime + usage.ru_stime, out, err


def old_layout_bytes(url: str, keys: Keys, batch_id: str, n: int) -> float:
    """Bytes per job had the record held the request too, as the SUBMIT_JOB before this change wrote it: the
    first `n` jobs' records given their request back (HSET) and the growth measured."""
    r = redis.Redis.from_url(url)
    before = int(r.info("memory")["used_memory"])
    queue = keys.queue("bulk", batch_id)
    last, done = "-", 0
    while done < n and (entries := r.xrange(queue, min=last, count=min(2000, n - done))):
        done += len(entries)
        pipe = r.pipeline(transaction=False)
        for _, fields in entries:
            pipe.hset(keys.job(fields[b"job_id"].decode()), "request", fields[b"request"])
        pipe.execute()
        last = "(" + entries[-1][0].decode()
    return (int(r.info("memory")["used_memory"]) - before) / n


def cli_route(path: Path, n: int, tmp: Path) -> dict:
    out: dict = {}
    with RedisServer() as srv:
        r, keys = redis.Redis.from_url(srv.url), Keys()
        env = dict(os.environ, TOKENBUS_REDIS_URL=srv.url, PYTHONPATH=str(ROOT))
        before, rcpu = int(r.info("memory")["used_memory"]), redis_cpu(r)
        secs, peak, cpu, stdout, log = run_cli(["-v", "batch", "submit", str(path)], env)
        stages = {k: float(v) for k, v in re.findall(r"(validate_s|enqueue_s)=([0-9.]+)", log)}
        bid = stdout.split()[-1]  # a generated id, batch_<32 hex> as the gateway's: ids as long as in use
        # stages: pass 1 (validate into the spool) and pass 2 (enqueue), seconds
        out["submit"] = step(n, secs, cpu, redis_cpu(r) - rcpu, peak_rss_mb=peak, **stages)
        out["redis"] = redis_bytes(r, keys, bid, before, n)
        print(
            f"cli submit: {n / secs:,.0f} lines/s, peak RSS {peak:.0f} MB, {out['redis']['bytes_per_job']:.0f} B/job",
            flush=True,
        )
        out["old_layout_extra_per_job"] = old_layout_bytes(srv.url, keys, bid, min(n, OLD_SAMPLE))
        out["finish_s"] = finish_all(r, keys, bid, n)
        rcpu = redis_cpu(r)
        secs, peak, cpu, _, _ = run_cli(["batch", "export", bid, str(tmp / "cli-out.jsonl")], env)
        with (tmp / "cli-out.jsonl").open("rb") as f:
            lines = sum(1 for _ in f)
        out["export"] = step(n, secs, cpu, redis_cpu(r) - rcpu, peak_rss_mb=peak, lines=lines)
        print(f"cli export: {n / secs:,.0f} lines/s, peak RSS {peak:.0f} MB", flush=True)
    return out


def report(res: dict) -> str:
    n, c, g = res["lines"], res.get("cli"), res.get("gateway")
    rows = [
        "| route | step | lines/s | seconds | peak RSS MB | process CPU µs/line | Redis CPU µs/line |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]

    def cpu(fig: dict) -> str:
        redis_us = fig.get("redis_cpu_us_per_line")
        return f" {fig['cpu_us_per_line']:.0f} | {'' if redis_us is None else f'{redis_us:.0f}'} |"

    if c:
        rows.append(
            f"| CLI | `tokenbus batch submit` | {c['submit']['lines_per_s']:,.0f} | "
            f"{c['submit']['seconds']:.1f} | {c['submit']['peak_rss_mb']:.0f} |" + cpu(c["submit"])
        )
        rows.append(
            f"| CLI | `tokenbus batch export` | {c['export']['lines_per_s']:,.0f} | "
            f"{c['export']['seconds']:.1f} | {c['export']['peak_rss_mb']:.0f} |" + cpu(c["export"])
        )
    if g:
        p = g["peak_rss_mb"]
        rows.append(
            f"| gateway | upload (POST /v1/files, validated as it streams) | {g['upload']['lines_per_s']:,.0f} "
            f"| {g['upload']['seconds']:.1f} | serve {p['serve']:.0f} |" + cpu(g["upload"])
        )
        rows.append(
            f"| gateway | submit (POST /v1/batches to in_progress: the tasks process) | "
            f"{g['submit']['lines_per_s']:,.0f} | {g['submit']['seconds']:.1f} | tasks {p['tasks']:.0f} |"
            + cpu(g["submit"])
        )
        rows.append(
            f"| gateway | finalisation (batch ended to output file) | {g['finalize']['lines_per_s']:,.0f} | "
            f"{g['finalize']['seconds']:.1f} | tasks {p['tasks']:.0f} |" + cpu(g["finalize"])
        )
    mem = [
        "| route | Redis B/job | request B | B/job beyond the request | record B (encoding) | stream B/job "
        "| id list B/job | Redis MB |",
        "|---|---:|---:|---:|---|---:|---:|---:|",
    ]
    for name, part in (("CLI", c), ("gateway", g)):
        if part:
            m = part["redis"]
            mem.append(
                f"| {name} | {m['bytes_per_job']:.0f} | {m['request_bytes']:.0f} | {m['overhead_per_job']:.0f} "
                f"| {m['record_bytes']:.0f} ({m['record_encoding']}) | {m['stream_bytes_per_job']:.0f} "
                f"| {m['id_list_bytes_per_job']:.1f} | {m['redis_mb']:.0f} |"
            )
    old = f"{c['old_layout_extra_per_job']:.0f}" if c else "?"
    idle = []
    for name, fig in (("CLI submit", c and c["submit"]), ("gateway submit", g and g["submit"])):
        if fig:
            proc, red = fig["cpu_us_per_line"], fig["redis_cpu_us_per_line"]
            idle.append(
                f"{name}: {1e6 / (proc + red):,.0f} lines/s with no overlap at all, {1e6 / max(proc, red):,.0f} "
                f"with the client and Redis each busy on its own core the whole time"
            )
    idle_text = (
        (
            "On two idle cores, the CPU per line bounds ingest at: " + "; ".join(idle) + ". The gateway's submit "
            "overlaps the two (one pass); the CLI's overlaps them only in pass 2 (pass 1 must see every line "
            "before anything is written)."
        )
        if idle
        else ""
    )
    split = ""
    if c and "validate_s" in c["submit"]:
        v, e = c["submit"]["validate_s"], c["submit"]["enqueue_s"]
        split = (
            f"The CLI's submit: pass 1 (validate into the spool) {v:.0f} s = {n / v:,.0f} lines/s, pass 2 (enqueue) "
            f"{e:.0f} s = {n / e:,.0f} lines/s; the rest is the process's start and the id list.\n"
        )
    return f"""# A million-line batch: ingest, export, memory

`python -m benchmarks.queue.million --lines {n}` on {res["machine"]}; each route against its own
redis-server {res["redis_version"]}, the input {n:,} chat lines of {res["line_bytes"]:.0f} bytes on average
({res["file_mb"]:.0f} MB).
No worker ran: ingest was measured with every job left queued, then every job was ended by FINISH_JOB (the
script a worker ends a job with; pipelined from the benchmark, a fixed one-token result) and the export
measured on those. Peak RSS is each process's VmHWM (the CLI's: its rusage). CPU µs/line: the process's
own CPU time (user + system) over the step, and Redis's (INFO cpu), per line: what the step costs whatever else
the machine runs. hiredis installed: {res["hiredis"]}.

{chr(10).join(rows)}

{split}
{idle_text}

Redis, per queued job (INFO used_memory growth over the submit / jobs; MEMORY USAGE of sample keys):

{chr(10).join(mem)}

The record holds no copy of the request while the job waits or runs (docs/protocol.md, "Stream entry"): it
stays a listpack hash of short fields. The same jobs' records given their request back, as the record was
before, grow Redis by a further {old} bytes a job (measured in this run on up to {OLD_SAMPLE:,} of the CLI route's
jobs). Main before this change measured 1,291 B/job beyond a 158-byte request at 20,000 lines; the issue 1,350.

How the submit streams (producer/batch_spool.py, producer/submit_pipe.py): pass 1 validates each line and
writes its final request JSON to a spool file on disk (the custom_ids checked for repeats in ~12 bytes each,
producer/seen_ids.py); pass 2 streams the spool to Redis, SUBMIT_JOBS with {CALL_JOBS} jobs a call and {DEPTH}
calls in flight while the next is packed. The gateway's upload writes the same spool as it validates, and its
tasks process streams that spool (pass 2 only: nothing validated again). Export and finalisation read the
records 1,000 at a time.
The machine is shared (load average during the run: {res["load"]}): lines/s are lower bounds.
"""


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--lines", type=int, default=1_000_000, help="lines of the batch file (default 1,000,000)")
    p.add_argument("--quick", action="store_true", help="20,000 lines, results to a temporary folder (not docs/)")
    p.add_argument("--routes", default="cli,gateway", help="comma-separated: cli, gateway")
    p.add_argument("--out", type=Path, help="folder for bench_million.md/.json (default docs/; --quick: a temp dir)")
    p.add_argument("--from-json", type=Path, help="only write the report again from a run's bench_million.json")
    a = p.parse_args()
    if a.from_json:
        text = report(json.loads(a.from_json.read_text()))
        (a.out or ROOT / "docs").joinpath("bench_million.md").write_text(text)
        print(text)
        return
    n = 20_000 if a.quick else a.lines
    out_dir = a.out or (Path(tempfile.mkdtemp(prefix="bench-million-")) if a.quick else ROOT / "docs")
    routes = a.routes.split(",")
    try:
        import hiredis  # noqa: F401

        has_hiredis = True
    except ImportError:
        has_hiredis = False
    with tempfile.TemporaryDirectory(prefix="bench-million-") as tmp_s:
        tmp = Path(tmp_s)
        path = tmp / "input.jsonl"
        size = write_file(path, n)
        res: dict = {
            "lines": n,
            "file_mb": size / 1e6,
            "line_bytes": size / n,
            "hiredis": has_hiredis,
            "machine": f"{os.cpu_count()} CPUs, Python {sys.version.split()[0]}",
            "redis_version": subprocess.run(["redis-server", "--version"], capture_output=True, text=True)
            .stdout.split()[2]
            .removeprefix("v="),
        }
        loads: list[float] = []
        stop = threading.Event()
        threading.Thread(
            target=lambda: [loads.append(os.getloadavg()[0]) for _ in iter(lambda: stop.wait(5), True)], daemon=True
        ).start()
        if "cli" in routes:
            res["cli"] = cli_route(path, n, tmp)
        if "gateway" in routes:
            res["gateway"] = gateway_route(path, n, tmp)
        stop.set()
        res["load"] = f"{min(loads):.1f}-{max(loads):.1f}" if loads else f"{os.getloadavg()[0]:.1f}"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_million.json").write_text(json.dumps(res, indent=1) + "\n")
    text = report(res)
    (out_dir / "bench_million.md").write_text(text)
    print(text)
    print(f"wrote {out_dir / 'bench_million.md'}")


if __name__ == "__main__":
    main()
