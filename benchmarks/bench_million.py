"""A million-line OpenAI batch through both routes, `tokenbus batch submit|export` and the gateway (upload,
POST /v1/batches, its tasks process's submit and finalisation), each against a private redis-server:
lines/s, the peak RSS of every process, and Redis bytes per queued job. Writes docs/bench_million.md + .json.

No worker runs: ingest is measured with the jobs left queued; then every job is ended by FINISH_JOB (the
script a worker ends a job with), pipelined from this process with a fixed one-token result, and the export
(the CLI's, and the gateway's finalisation into its output file) is measured on those.

    python -m benchmarks.bench_million [--lines 1000000] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import redis

from protocol.keys import Keys
from protocol.scripts import finish_job
from tests.support.local_redis import RedisServer, free_port

ROOT = Path(__file__).resolve().parent.parent
KEY = "sk-bench-" + "m" * 24
OLD_SAMPLE = 50_000  # jobs whose records are given their request back to measure the old layout
RESULT = json.dumps(
    {
        "text": "ok",
        "token_ids": [1],
        "finish_reason": "length",
        "usage": {"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13},
    }
)


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


def hwm_mb(pid: int) -> float:
    """Peak RSS of a live process (VmHWM), MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


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


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a live process has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def redis_cpu(r: redis.Redis) -> float:
    info = r.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def finish_all(r: redis.Redis, keys: Keys, batch_id: str, n: int) -> float:
    """End every job finished, as a worker would (FINISH_JOB), pipelined; returns seconds."""
    t0 = time.perf_counter()
    for start in range(0, n, 2000):
        pipe = r.pipeline(transaction=False)
        for i in range(start, min(n, start + 2000)):
            finish_job(pipe, keys, f"{batch_id}-{i}", "finished", result=RESULT)
        pipe.execute()
    return time.perf_counter() - t0


def redis_bytes(r: redis.Redis, keys: Keys, batch_id: str, before: int, n: int) -> dict[str, float]:
    """used_memory growth per job, the request's own bytes, and MEMORY USAGE of the keys a job adds to."""
    grew = int(r.info("memory")["used_memory"]) - before
    queue = keys.queue("bulk", batch_id)
    sample = r.xrange(queue, count=1000)
    request = sum(len(f[b"request"]) for _, f in sample) / max(1, len(sample))
    record = [r.memory_usage(keys.job(f"{batch_id}-{i}")) or 0 for i in range(0, n, max(1, n // 200))]
    return {
        "bytes_per_job": grew / n,
        "request_bytes": request,
        "overhead_per_job": grew / n - request,
        "record_bytes": sum(record) / len(record),
        "record_encoding": r.object("encoding", keys.job(f"{batch_id}-0")).decode(),
        "stream_bytes_per_job": (r.memory_usage(queue, samples=0) or 0) / n,
        "id_list_bytes_per_job": (r.memory_usage(keys.batch_jobs(batch_id), samples=0) or 0) / n,
        "redis_mb": grew / 1e6,
    }


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
        out["submit"] = {
            "seconds": secs,
            "lines_per_s": n / secs,
            "peak_rss_mb": peak,
            "cpu_us_per_line": cpu / n * 1e6,
            "redis_cpu_us_per_line": (redis_cpu(r) - rcpu) / n * 1e6,
            **stages,  # pass 1 (validate into the spool) and pass 2 (enqueue), seconds
        }
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
        out["export"] = {
            "seconds": secs,
            "lines_per_s": n / secs,
            "peak_rss_mb": peak,
            "lines": lines,
            "cpu_us_per_line": cpu / n * 1e6,
            "redis_cpu_us_per_line": (redis_cpu(r) - rcpu) / n * 1e6,
        }
        print(f"cli export: {n / secs:,.0f} lines/s, peak RSS {peak:.0f} MB", flush=True)
    return out


class Gateway:
    """`tokenbus-gateway serve` and `tasks` on a private redis-server, limits opened for a million lines."""

    def __init__(self, srv: RedisServer, tmp: Path) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        env = dict(
            os.environ,
            PYTHONPATH=str(ROOT),
            TOKENBUS_REDIS_URL=srv.url,
            TOKENBUS_LOG_JSON="1",
            TOKENBUS_GATEWAY_API_KEYS=KEY,
            TOKENBUS_GATEWAY_PORT=str(port),
            TOKENBUS_GATEWAY_FILES_DIR=str(tmp / "files"),
            TOKENBUS_GATEWAY_MAX_UPLOAD_BYTES=str(4 << 30),
            TOKENBUS_GATEWAY_MAX_REQUESTS_PER_FILE="10000000",
            TOKENBUS_GATEWAY_MAX_QUEUED_REQUESTS_PER_KEY="10000000",
            TOKENBUS_GATEWAY_MAX_QUEUED_TOKENS_PER_KEY="100000000000",
            TOKENBUS_GATEWAY_MAX_QUEUED_BYTES_PER_KEY=str(64 << 30),
            TOKENBUS_GATEWAY_MAX_QUEUED_BYTES=str(64 << 30),
            TOKENBUS_GATEWAY_WATCH_INTERVAL_S="0.5",
            TOKENBUS_GATEWAY_MIN_BODY_RATE="1024",
        )
        self.logs = [open(tmp / f"{name}.log", "w") for name in ("serve", "tasks")]  # noqa: SIM115
        self.procs = {
            name: subprocess.Popen(
                [sys.executable, "-m", "gateway", name], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
            )
            for name, log in zip(("serve", "tasks"), self.logs, strict=True)
        }
        self.http = httpx.Client(base_url=self.url, headers={"authorization": f"Bearer {KEY}"}, timeout=3600)
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the gateway did not start: see its log")
            time.sleep(0.2)

    def cpu(self) -> dict[str, float]:
        return {name: cpu_s(p.pid) for name, p in self.procs.items()}

    def peaks(self) -> dict[str, float]:
        return {name: hwm_mb(p.pid) for name, p in self.procs.items()}

    def batch(self, batch_id: str) -> dict:
        return self.http.get(f"/v1/batches/{batch_id}").raise_for_status().json()

    def wait(self, batch_id: str, until, timeout: float = 7200) -> dict:
        deadline = time.monotonic() + timeout
        while not until(b := self.batch(batch_id)):
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"gateway {name} exited ({p.returncode})")
            if time.monotonic() > deadline:
                raise RuntimeError(f"batch {batch_id} stuck: {b}")
            time.sleep(0.25)
        return b

    def close(self) -> None:
        for p in self.procs.values():
            p.terminate()
            p.wait(30)
        for log in self.logs:
            log.close()


def gateway_route(path: Path, n: int, tmp: Path) -> dict:
    out: dict = {}
    with RedisServer() as srv:
        r, keys = redis.Redis.from_url(srv.url), Keys()
        gw = Gateway(srv, tmp)
        try:
            out["idle_rss_mb"] = gw.peaks()
            cpu0 = gw.cpu()
            t0 = time.perf_counter()
            with path.open("rb") as f:
                meta = (
                    gw.http.post(
                        "/v1/files", data={"purpose": "batch"}, files={"file": (path.name, f, "application/jsonl")}
                    )
                    .raise_for_status()
                    .json()
                )
            secs = time.perf_counter() - t0
            cpu1 = gw.cpu()
            out["upload"] = {
                "seconds": secs,
                "lines_per_s": n / secs,
                "cpu_us_per_line": (cpu1["serve"] - cpu0["serve"]) / n * 1e6,
            }
            print(f"gateway upload: {n / secs:,.0f} lines/s", flush=True)
            before, rcpu = int(r.info("memory")["used_memory"]), redis_cpu(r)
            t0 = time.perf_counter()
            batch = (
                gw.http.post(
                    "/v1/batches",
                    json={"input_file_id": meta["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"},
                )
                .raise_for_status()
                .json()
            )
            gw.wait(batch["id"], lambda b: b["status"] != "validating")
            secs = time.perf_counter() - t0
            cpu2 = gw.cpu()
            out["submit"] = {
                "seconds": secs,
                "lines_per_s": n / secs,
                "cpu_us_per_line": (cpu2["tasks"] - cpu1["tasks"]) / n * 1e6,
                "redis_cpu_us_per_line": (redis_cpu(r) - rcpu) / n * 1e6,
            }
            out["redis"] = redis_bytes(r, keys, batch["id"], before, n)
            print(f"gateway submit: {n / secs:,.0f} lines/s, {out['redis']['bytes_per_job']:.0f} B/job", flush=True)
            out["finish_s"] = finish_all(r, keys, batch["id"], n)
            cpu3 = gw.cpu()
            t0 = time.perf_counter()
            done = gw.wait(batch["id"], lambda b: b["status"] in ("completed", "failed", "cancelled", "expired"))
            secs = time.perf_counter() - t0
            out["finalize"] = {
                "seconds": secs,
                "lines_per_s": n / secs,
                "status": done["status"],
                "cpu_us_per_line": (gw.cpu()["tasks"] - cpu3["tasks"]) / n * 1e6,
            }
            t0 = time.perf_counter()
            lines = 0
            with gw.http.stream("GET", f"/v1/files/{done['output_file_id']}/content") as resp:
                for _ in resp.iter_lines():
                    lines += 1
            out["download"] = {"seconds": time.perf_counter() - t0, "lines": lines}
            print(f"gateway finalize: {n / secs:,.0f} lines/s; output {lines} lines", flush=True)
            out["peak_rss_mb"] = gw.peaks()
        finally:
            gw.close()
    return out


def report(res: dict) -> str:
    n, c, g = res["lines"], res.get("cli"), res.get("gateway")
    rows = [
        "| route | step | lines/s | seconds | peak RSS MB | process CPU µs/line | Redis CPU µs/line |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]

    def cpu(step: dict) -> str:
        redis_us = step.get("redis_cpu_us_per_line")
        return f" {step['cpu_us_per_line']:.0f} | {'' if redis_us is None else f'{redis_us:.0f}'} |"

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
    for name, step in (("CLI submit", c and c["submit"]), ("gateway submit", g and g["submit"])):
        if step:
            proc, red = step["cpu_us_per_line"], step["redis_cpu_us_per_line"]
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

`python -m benchmarks.bench_million --lines {n}` on {res["machine"]}; each route against its own
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
producer/seen_ids.py); pass 2 streams the spool to Redis, SUBMIT_JOB in chunks of 1,000 with two chunks in
flight while the next is packed. The gateway's tasks process reads a file its upload validated in one pass,
each line sent as it is validated again (no spool). Export and finalisation read the records 1,000 at a time.
The machine is shared (load average during the run: {res["load"]}): lines/s are lower bounds.
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
