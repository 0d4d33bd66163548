"""What benchmarks/queue/million.py measures of a process and of Redis: peak RSS, CPU seconds, Redis bytes per
job, and every job ended by FINISH_JOB as a worker would end it (shared by both routes)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import redis

from protocol.keys import Keys
from protocol.scripts import finish_job

RESULT = json.dumps(
    {
        "text": "ok",
        "token_ids": [1],
        "finish_reason": "length",
        "usage": {"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13},
    }
)


def hwm_mb(pid: int) -> float:
    """Peak RSS of a live process (VmHWM), MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


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


def step(n: int, secs: float, cpu: float, redis_cpu_s: float | None = None, **extra: object) -> dict:
    """One step's figures over n lines: seconds, lines/s, the process's CPU µs a line (and Redis's), extra."""
    out = {"seconds": secs, "lines_per_s": n / secs, "cpu_us_per_line": cpu / n * 1e6, **extra}
    if redis_cpu_s is not None:
        out["redis_cpu_us_per_line"] = redis_cpu_s / n * 1e6
    return out
