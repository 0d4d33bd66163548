"""System (1) of e2e/compare.py: the "polite queue" — an RQ worker running HF `generate` for one job at a time.

The worker is rq's SimpleWorker (no fork per job, so the model loaded by the first job stays in the worker
process: the usual way to serve a model from RQ). `generate_one` is the job function the worker imports from
this module; `run_rq` is what the benchmark calls: start the worker, warm it with one job, enqueue every
request, wait for the last result.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

from bench.worker_process import stop_process

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUEUE = "bench-e2e-rq"

_model: Any = None  # loaded by the first job a worker runs, kept for the rest


def _load(threads: int) -> Any:
    global _model
    if _model is None:
        import torch
        from transformers import AutoModelForCausalLM

        from worker.engine import loader

        torch.set_num_threads(threads)
        source = loader.resolve("smollm2-135m")
        _model = AutoModelForCausalLM.from_pretrained(source.directory, dtype=torch.float32).eval()
    return _model


def generate_one(prompt_ids: list[int], max_tokens: int, threads: int) -> dict[str, Any]:
    """The job: greedy, EOS ignored (min_new_tokens = max_new_tokens), like every other system."""
    import torch

    loaded_before = _model is not None
    started = time.time()
    model = _load(threads)
    with torch.inference_mode():
        x = torch.tensor([prompt_ids])
        y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens,
                           min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    return {"token_ids": y[0, len(prompt_ids):].tolist(), "loaded_model": not loaded_before,
            "seconds": time.time() - started}


@dataclass
class RqRun:
    seconds: float  # first enqueue -> last result
    outputs: list[list[int]]
    latencies: list[float]  # enqueued_at -> ended_at per job (rq's own timestamps)
    warmup_seconds: float  # the first job, which loads the model (not in `seconds`)


def run_rq(redis_url: str, prompt_ids: list[list[int]], max_tokens: list[int], threads: int,
           log_path: str, timeout: float = 3600.0) -> RqRun:
    import redis
    from rq import Queue

    conn = redis.Redis.from_url(redis_url)
    queue = Queue(QUEUE, connection=conn)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    with open(log_path, "w") as log:
        worker = subprocess.Popen(
            [sys.executable, "-m", "rq.cli", "worker", "--url", redis_url, "--worker-class", "rq.SimpleWorker",
             "--disable-job-desc-logging", QUEUE],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        t0 = time.perf_counter()
        warm = queue.enqueue(generate_one, prompt_ids[0], 2, threads, job_timeout=600, result_ttl=3600)
        _wait(warm, worker, timeout)
        warmup_seconds = time.perf_counter() - t0

        start = time.perf_counter()
        jobs = [queue.enqueue(generate_one, ids, m, threads, job_timeout=3600, result_ttl=3600)
                for ids, m in zip(prompt_ids, max_tokens, strict=True)]
        results = [_wait(job, worker, timeout) for job in jobs]  # one worker: they end in this order
        seconds = time.perf_counter() - start
        for job in jobs:
            job.refresh()
        latencies = [(job.ended_at - job.enqueued_at).total_seconds() for job in jobs]
        return RqRun(seconds, [r["token_ids"] for r in results], latencies, warmup_seconds)
    finally:
        stop_process(worker, 30)  # warm shutdown: nothing is running by now
        conn.close()


def _wait(job: Any, worker: subprocess.Popen, timeout: float) -> dict[str, Any]:
    """Block until the job has a result (rq 3 blocks on its results stream); fail fast if the worker died."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = job.latest_result(timeout=1)
        if result is not None:
            if result.type != result.Type.SUCCESSFUL:
                raise RuntimeError(f"RQ job {job.id} failed: {result.exc_string}")
            return result.return_value
        if worker.poll() is not None:
            raise RuntimeError(f"the RQ worker exited with code {worker.returncode} before job {job.id} ended")
    raise TimeoutError(f"RQ job {job.id} had no result after {timeout} s")
