"""A `python -m worker` process as the benchmarks run it: started with its log in a file, waited for until its
heartbeat shows, read through its /metrics, and stopped (SIGTERM, then SIGKILL after a grace)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[1])


def worker_env(threads: int | None = None, **extra: str) -> dict[str, str]:
    """The environment of a benchmark's worker: this checkout first on PYTHONPATH, offline, `threads` torch
    threads when given."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), **extra)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def start_worker(redis_url: str, model: str, log_path: str | Path, *flags: str, threads: int | None = None,
                 env: dict[str, str] | None = None) -> subprocess.Popen:
    """`python -m worker --redis-url URL --model MODEL *flags` on the CPU in float32, its output into log_path.
    `env` adds to worker_env (TOKENBUS_KEY=VALUE: an engine setting)."""
    args = [sys.executable, "-m", "worker", "--redis-url", redis_url, "--model", model, "--device", "cpu",
            "--dtype", "float32", *flags]
    with open(log_path, "w") as log:
        return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=worker_env(threads, **(env or {})),
                                cwd=ROOT)


def wait_heartbeat(client, worker: subprocess.Popen, log_path: str | Path, timeout: float = 300.0) -> float:
    """Seconds until a worker's heartbeat shows in client.info(); raises with the log's tail if it exits."""
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        if worker.poll() is not None:
            tail = Path(log_path).read_text(errors="replace")[-2000:]
            raise RuntimeError(f"the tokenbus worker exited with code {worker.returncode}:\n{tail}")
        if any(w.alive for w in client.info().workers):
            return time.perf_counter() - start
        time.sleep(0.1)
    raise TimeoutError(f"no worker heartbeat after {timeout} s (log: {log_path})")


def metric_samples(metrics_port: int, family_name: str) -> dict[str, float]:
    """{sample name with its labels: value} of one metric family on the worker's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    return {sample.name + "".join(f"{{{k}={v}}}" for k, v in sorted(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text) if family.name == family_name
            for sample in family.samples}


def step_seconds(metrics_port: int) -> tuple[int, float]:
    """(steps, seconds inside engine steps) so far, from the worker's tokenbus_step_seconds histogram."""
    samples = metric_samples(metrics_port, "tokenbus_step_seconds")
    if "tokenbus_step_seconds_count" not in samples:
        raise RuntimeError("the worker's /metrics has no tokenbus_step_seconds histogram")
    return int(samples["tokenbus_step_seconds_count"]), samples["tokenbus_step_seconds_sum"]


def stop_process(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM (the workers drain or shut down warm), then SIGKILL if it has not exited within grace_s."""
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
