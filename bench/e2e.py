"""tokenbus end to end: producer.Client -> Redis -> a `python -m worker` process -> job records. What
`tokenbus bench e2e` runs, and system (6) of benchmarks/e2e/compare.py (the same function, so the figures
compare)."""

from __future__ import annotations

import time

from bench.harness import DEFAULT_MODEL, Timed
from bench.worker_process import metric_samples, start_worker, step_seconds, stop_process, wait_heartbeat

NAMESPACE = "bench-e2e"


def run_e2e(redis_url: str, prompt_ids: list[list[int]], max_tokens: list[int], threads: int, log_path: str,
            max_num_seqs: int = 64, max_num_batched_tokens: int = 512, timeout: float = 3600.0,
            prefix_caching: bool = True, model: str = DEFAULT_MODEL,
            settings: dict[str, object] | None = None) -> Timed:
    """Start a worker, wait for its heartbeat, warm it with one job, then submit_many + as_completed.

    Throughput: first submit -> last job read back. TTFT = first_token_at - created_at and latency =
    finished_at - created_at, from each job record (the worker's and the producer's clocks: one machine).
    The worker's step histogram gives the steps it took and the time spent outside them: the queue's own
    overhead, measured inside one run (a ratio to the offline engine's separate run also carries the drift).
    `settings` are engine settings, passed to the worker as TOKENBUS_KEY=VALUE.
    """
    from producer import Client
    from testbed.redis_server import free_port

    metrics_port = free_port()
    env = {f"TOKENBUS_{k.upper()}": str(v).lower() if isinstance(v, bool) else str(v)
           for k, v in (settings or {}).items()}
    worker = start_worker(
        redis_url, model, log_path, "--namespace", NAMESPACE, "--max-num-seqs", str(max_num_seqs),
        "--max-num-batched-tokens", str(max_num_batched_tokens), "--heartbeat-s", "1",
        "--worker-name", "bench-e2e-worker", "--log-json", "true", "--metrics-port", str(metrics_port),
        "--enable-prefix-caching", str(prefix_caching).lower(), "--log-level", "warning", threads=threads, env=env)
    client = Client(redis_url, namespace=NAMESPACE)
    try:
        load_s = wait_heartbeat(client, worker, log_path)
        warm = client.submit(prompt_token_ids=prompt_ids[0], max_tokens=2, temperature=0.0)
        client.wait(warm, timeout=300)
        requests = [{"prompt_token_ids": ids, "max_tokens": m, "temperature": 0.0, "ignore_eos": True}
                    for ids, m in zip(prompt_ids, max_tokens, strict=True)]
        steps_before, stepping_before = step_seconds(metrics_port)
        start = time.perf_counter()
        ids = client.submit_many(requests)
        done = {job.id: job for job in client.as_completed(ids, timeout=timeout)}
        seconds = time.perf_counter() - start
        steps_after, stepping_after = step_seconds(metrics_port)
        hit_rate = metric_samples(metrics_port, "tokenbus_prefix_cache_hit_rate").get(
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

