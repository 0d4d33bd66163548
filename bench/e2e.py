"""Systems (5) and (6) of bench_e2e.py: the tokenbus engine offline, and tokenbus end to end
(producer.Client -> Redis -> `python -m worker` subprocess -> job records)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field

from benchmarks.harness.common import stop_process

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMESPACE = "bench-e2e"


@dataclass
class Timed:
    """One system's run: outputs in request order, wall seconds, and per-request times where it has them."""

    seconds: float
    outputs: list[list[int]]
    ttfts: list[float] | None = None
    latencies: list[float] | None = None
    extra: dict[str, str] = field(default_factory=dict)


def engine_offline(prompt_ids: list[list[int]], max_tokens: list[int], max_num_seqs: int = 64,
                   max_num_batched_tokens: int = 512) -> Timed:
    """Engine.generate on every request at once (all arrive at t=0, so TTFT includes waiting for a seat)."""
    from worker import Engine, SamplingParams

    engine = Engine("smollm2-135m", device="cpu", dtype="float32", max_num_seqs=max_num_seqs,
                    max_num_batched_tokens=max_num_batched_tokens)
    engine.generate([prompt_ids[0]], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]
    start = time.perf_counter()
    outs = engine.generate(prompt_ids, params)
    seconds = time.perf_counter() - start
    stats = engine.stats()
    return Timed(seconds, [o.token_ids for o in outs],
                 ttfts=[o.first_token_time - o.arrival_time for o in outs],
                 latencies=[o.finish_time - o.arrival_time for o in outs],
                 extra={"steps": str(stats.steps), "preemptions": str(stats.preemptions)})


def _step_seconds(metrics_port: int) -> tuple[int, float]:
    """(steps, seconds inside engine steps) so far, from the worker's tokenbus_step_seconds histogram."""
    samples = _samples(metrics_port, "tokenbus_step_seconds")
    if "tokenbus_step_seconds_count" not in samples:
        raise RuntimeError("the worker's /metrics has no tokenbus_step_seconds histogram")
    return int(samples["tokenbus_step_seconds_count"]), samples["tokenbus_step_seconds_sum"]


def _samples(metrics_port: int, family_name: str) -> dict[str, float]:
    """{sample name with its labels: value} of one metric family on the worker's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    return {sample.name + "".join(f"{{{k}={v}}}" for k, v in sorted(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text) if family.name == family_name
            for sample in family.samples}


def _start_worker(redis_url: str, threads: int, log_path: str, max_num_seqs: int,
                  max_num_batched_tokens: int, metrics_port: int, prefix_caching: bool = True) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    args = [sys.executable, "-m", "worker", "--redis-url", redis_url, "--namespace", NAMESPACE,
            "--model", "smollm2-135m", "--device", "cpu", "--dtype", "float32",
            "--max-num-seqs", str(max_num_seqs), "--max-num-batched-tokens", str(max_num_batched_tokens),
            "--heartbeat-s", "1", "--worker-name", "bench-e2e-worker", "--log-json", "true",
            "--metrics-port", str(metrics_port), "--enable-prefix-caching", str(prefix_caching).lower(),
            "--log-level", "warning"]
    with open(log_path, "w") as log:
        return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)


def _wait_heartbeat(client, worker: subprocess.Popen, log_path: str, timeout: float = 300.0) -> float:
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        if worker.poll() is not None:
            tail = open(log_path).read()[-2000:]
            raise RuntimeError(f"the tokenbus worker exited with code {worker.returncode}:\n{tail}")
        if any(w.alive for w in client.info().workers):
            return time.perf_counter() - start
        time.sleep(0.1)
    raise TimeoutError(f"no worker heartbeat after {timeout} s (log: {log_path})")


def run_e2e(redis_url: str, prompt_ids: list[list[int]], max_tokens: list[int], threads: int, log_path: str,
            max_num_seqs: int = 64, max_num_batched_tokens: int = 512, timeout: float = 3600.0,
            prefix_caching: bool = True) -> Timed:
    """Start a worker, wait for its heartbeat, warm it with one job, then submit_many + as_completed.

    Throughput: first submit -> last job read back. TTFT = first_token_at - created_at and latency =
    finished_at - created_at, from each job record (the worker's and the producer's clocks: one machine).
    The worker's step histogram gives the steps it took and the time spent outside them: the queue's own
    overhead, measured inside one run (a ratio to the offline engine's separate run also carries the drift).
    """
    from producer import Client
    from testbed.redis_server import free_port

    metrics_port = free_port()
    worker = _start_worker(redis_url, threads, log_path, max_num_seqs, max_num_batched_tokens, metrics_port,
                           prefix_caching)
    client = Client(redis_url, namespace=NAMESPACE)
    try:
        load_s = _wait_heartbeat(client, worker, log_path)
        warm = client.submit(prompt_token_ids=prompt_ids[0], max_tokens=2, temperature=0.0)
        client.wait(warm, timeout=300)
        requests = [{"prompt_token_ids": ids, "max_tokens": m, "temperature": 0.0, "ignore_eos": True}
                    for ids, m in zip(prompt_ids, max_tokens, strict=True)]
        steps_before, stepping_before = _step_seconds(metrics_port)
        start = time.perf_counter()
        ids = client.submit_many(requests)
        done = {job.id: job for job in client.as_completed(ids, timeout=timeout)}
        seconds = time.perf_counter() - start
        steps_after, stepping_after = _step_seconds(metrics_port)
        hit_rate = _samples(metrics_port, "tokenbus_prefix_cache_hit_rate").get(
            "tokenbus_prefix_cache_hit_rate{unit=tokens}", 0.0)
        outside = seconds - (stepping_after - stepping_before)
        jobs = [done[i] for i in ids]
        failed = [j for j in jobs if j.status != "finished" or j.result is None]
        if failed:
            raise RuntimeError(f"{len(failed)} jobs did not finish, first: {failed[0].id} {failed[0].status} "
                               f"{failed[0].error}")
        return Timed(seconds, [j.result.token_ids for j in jobs],
                     ttfts=[j.first_token_at - j.created_at for j in jobs],
                     latencies=[j.finished_at - j.created_at for j in jobs],
                     extra={"worker load s": f"{load_s:.1f}", "steps": str(steps_after - steps_before),
                            "prefix-cache token hit rate": f"{hit_rate:.1%}",
                            "time outside engine steps": f"{outside:.2f} s ({outside / seconds:.1%} of the wall time)"})
    finally:
        stop_process(worker, 60)  # drains (nothing is in flight by now) and exits
        client.close()
