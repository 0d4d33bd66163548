"""A million jobs end to end on this machine: producer.Client -> a private redis-server -> --workers
`python -m worker` processes in one consumer group -> job records read back with as_completed.

    .venv/bin/python -m benchmarks.e2e.million_jobs                 # 1,000,000 jobs, writes docs/scaling.md
    .venv/bin/python -m benchmarks.e2e.million_jobs --quick         # 2,000 jobs: a smoke run, no doc

The model is a tiny random-weight Llama (testbed/tiny_models.py) and every job asks for one token
(max_tokens 1, a 4-token prompt), so what is measured is the system around the engine: validation, the
SUBMIT_JOB script, intake (READ + START_JOB), the result write (FINISH_JOB), the event and the read-back.
The producer submits in chunks with max_queue_len as backpressure (a chunk that does not fit waits and
retries what was refused), so Redis holds at most --backlog queued jobs; a reader thread follows each chunk
with as_completed. Side by side in the same run: the engine alone (Engine.generate, one process, no Redis)
on --engine-jobs of the same jobs, and each worker's own split of its time (the tokenbus_step_seconds
histogram: inside engine steps, and the rest).
"""

from __future__ import annotations

import argparse
import os
import platform
import queue
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

from bench.harness import parser
from bench.worker_process import start_worker, step_seconds, stop_process
from benchmarks.harness.docs import write_section

NAMESPACE = "bench-million"
PROMPT = [1, 450, 4996, 17354]  # 4 tokens; max_tokens 1: one prefill step per job


@dataclass
class Run:
    jobs: int
    workers: int
    seconds: float = 0.0
    submit_seconds: float = 0.0
    finished: int = 0
    failed: int = 0
    full_waits: int = 0  # chunks that met max_queue_len and waited
    engine_jobs: int = 0
    engine_seconds: float = 0.0
    step_seconds: float = 0.0  # summed over the workers: inside engine steps
    steps: int = 0
    redis_peak_bytes: int = 0
    counter_ok: bool = False
    progress: list[tuple[float, int]] = field(default_factory=list)


def engine_alone(model_dir: str, n: int, max_num_seqs: int, cpu_kernels: bool) -> float:
    """Seconds for Engine.generate on n one-token jobs, after a warm-up (the engine's own cost per job)."""
    from worker import Engine, SamplingParams

    engine = Engine(model_dir, device="cpu", dtype="float32", max_num_seqs=max_num_seqs,
                    max_num_batched_tokens=max(256, 4 * max_num_seqs), kv_cache_gb=0.2, cpu_kernels=cpu_kernels)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine.generate([PROMPT] * 8, [params] * 8)
    start = time.perf_counter()
    outs = engine.generate([PROMPT] * n, [params] * n)
    seconds = time.perf_counter() - start
    assert all(len(o.token_ids) == 1 for o in outs)
    del engine
    return seconds


def start_one(url: str, model_dir: str, i: int, max_num_seqs: int, metrics_port: int, log_dir: str,
              cpu_kernels: bool):
    return start_worker(url, model_dir, os.path.join(log_dir, f"worker-{i}.log"), "--namespace", NAMESPACE,
                        "--max-num-seqs", str(max_num_seqs),
                        "--max-num-batched-tokens", str(max(256, 4 * max_num_seqs)), "--kv-cache-gb", "0.2",
                        "--intake-lookahead", str(max_num_seqs), "--heartbeat-s", "1",
                        "--worker-name", f"million-{i}", "--metrics-port", str(metrics_port), "--log-json", "true",
                        "--log-level", "warning", "--cpu-kernels", str(cpu_kernels).lower(), threads=1)


def step_totals(ports: list[int]) -> tuple[int, float]:
    pairs = [step_seconds(p) for p in ports]
    return sum(n for n, _ in pairs), sum(s for _, s in pairs)


def produce(client, n: int, chunk: int, out: queue.Queue, run: Run, max_seconds: float) -> None:
    """Submit n jobs in chunks; a chunk refused by max_queue_len waits for the workers and retries the rest.
    With max_seconds, stop after that long (run.jobs becomes the number submitted)."""
    from protocol.errors import QueueFull

    request = {"prompt_token_ids": PROMPT, "max_tokens": 1, "temperature": 0.0, "ignore_eos": True}
    start = time.perf_counter()
    submitted = 0
    for first in range(0, n, chunk):
        if max_seconds and time.perf_counter() - start > max_seconds:
            break
        todo = [dict(request) for _ in range(min(chunk, n - first))]
        ids: list[str] = []
        while todo:
            try:
                ids += client.submit_many(todo)
                todo = []
            except QueueFull as err:
                ids += err.accepted
                todo = todo[len(err.accepted):]
                run.full_waits += 1
                time.sleep(0.2)
        out.put(ids)
        submitted += len(ids)
    run.jobs = submitted
    run.submit_seconds = time.perf_counter() - start
    out.put(None)


def run_system(args, model_dir: str, log_dir: str) -> Run:
    from producer import Client
    from protocol import scripts
    from protocol.connection import redis_from_url
    from testbed.redis_server import RedisServer, free_port

    def client_of(url: str) -> Client:  # a long socket timeout: the machine is shared, a reply can take seconds
        r = redis_from_url(url, decode_responses=True, encoding_errors="replace", socket_timeout=300)
        return Client(url, namespace=NAMESPACE, max_queue_len=args.backlog, result_ttl=args.result_ttl,
                      redis_client=r)

    run = Run(args.jobs, args.workers)
    server = RedisServer().start()
    workers, ports = [], []
    try:
        for i in range(args.workers):
            ports.append(free_port())
            workers.append(start_one(server.url, model_dir, i, args.max_num_seqs, ports[-1], log_dir,
                                     args.cpu_kernels))
        client = client_of(server.url)
        deadline = time.monotonic() + 600
        while sum(w.alive for w in client.info().workers) < args.workers:
            if any(w.poll() is not None for w in workers) or time.monotonic() > deadline:
                raise RuntimeError(f"a worker did not start: see {log_dir}/worker-*.log")
            time.sleep(0.5)
        client.wait(client.submit(prompt_token_ids=PROMPT, max_tokens=1), timeout=300)  # warm-up
        steps0, stepping0 = step_totals(ports)
        chunks: queue.Queue = queue.Queue()
        producer = threading.Thread(target=produce, args=(client_of(server.url), args.jobs, args.chunk, chunks, run,
                                                          args.max_seconds), daemon=True)
        start = time.perf_counter()
        producer.start()
        next_report = start + 10
        while (ids := chunks.get()) is not None:
            for job in client.as_completed(ids, timeout=3600):
                if job.status == "finished" and job.result is not None and len(job.result.token_ids) == 1:
                    run.finished += 1
                else:
                    run.failed += 1
            if time.perf_counter() >= next_report:
                t = time.perf_counter() - start
                run.progress.append((t, run.finished))
                print(f"  {t:7.1f} s  {run.finished:>9,} finished  {run.finished / t:8.0f} jobs/s  "
                      f"(Redis used_memory {client.redis.info('memory')['used_memory'] / 2**20:,.0f} MiB)", flush=True)
                next_report += 10
        run.seconds = time.perf_counter() - start
        producer.join()
        steps1, stepping1 = step_totals(ports)
        run.steps, run.step_seconds = steps1 - steps0, stepping1 - stepping0
        run.redis_peak_bytes = int(client.redis.info("memory")["used_memory_peak"])
        depth = scripts.depth(client.redis, client.keys)
        run.counter_ok = (depth.total, depth.pending) == scripts.queue_totals(client.redis, client.keys) == (0, 0)
    finally:
        for w in workers:
            stop_process(w, 30)
        server.stop()
    return run


def report(args, run: Run) -> str:
    per_job = run.seconds / run.jobs * 1e6
    engine_per_job = run.engine_seconds / run.engine_jobs * 1e6
    busy = run.workers * run.seconds  # worker-seconds of wall time
    outside = (busy - run.step_seconds) / run.jobs * 1e6
    lines = [
        (f"{run.jobs:,} of --jobs {args.jobs:,} (stopped submitting at --max-seconds {args.max_seconds:.0f}): "
         if run.jobs < args.jobs else "") +
        f"{run.jobs:,} jobs (max_tokens 1, a 4-token prompt) through {run.workers} worker processes in one "
        f"consumer group, tiny random-weight Llama (hidden 128, 2 layers, SmolLM2 vocabulary), "
        f"max_num_seqs {args.max_num_seqs}, C++ CPU kernels {'on' if args.cpu_kernels else 'off'}, "
        f"backlog bound (max_queue_len) {args.backlog:,}, "
        f"{os.cpu_count()} CPU cores shared with other work, Python {platform.python_version()}.",
        "",
        "| measure | value |",
        "|---|---|",
        f"| jobs finished / failed | {run.finished:,} / {run.failed:,} |",
        f"| wall time, first submit to last result read | {run.seconds:,.1f} s |",
        f"| **jobs/s through the whole system** | **{run.jobs / run.seconds:,.0f}** |",
        f"| submit (producer thread, incl. backpressure waits) | {run.submit_seconds:,.1f} s, "
        f"{run.full_waits:,} waits on max_queue_len |",
        f"| wall time per job | {per_job:,.0f} µs |",
        f"| engine alone per job (Engine.generate, {run.engine_jobs:,} jobs, one process, same run) | "
        f"{engine_per_job:,.0f} µs |",
        f"| workers' time inside engine steps per job (summed over workers) | "
        f"{run.step_seconds / run.jobs * 1e6:,.0f} µs ({run.steps:,} steps) |",
        f"| **queue overhead per job**: workers' time outside engine steps (intake, scripts, results), "
        f"summed over workers | **{outside:,.0f} µs** |",
        f"| Redis peak memory | {run.redis_peak_bytes / 2**20:,.0f} MiB |",
        f"| depth counter = recount = (0, 0) at the end | {'yes' if run.counter_ok else 'NO'} |",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = parser(__doc__, docs=True)
    ap.add_argument("--jobs", type=int, default=1_000_000, help="jobs to submit and wait for")
    ap.add_argument("--workers", type=int, default=2, help="worker processes (one consumer group)")
    ap.add_argument("--max-num-seqs", type=int, default=128, help="each worker's seats")
    ap.add_argument("--backlog", type=int, default=200_000, help="max_queue_len: queued jobs at most")
    ap.add_argument("--chunk", type=int, default=5_000, help="jobs per submit_many call")
    ap.add_argument("--result-ttl", type=int, default=120, help="seconds a finished record is kept")
    ap.add_argument("--engine-jobs", type=int, default=5_000, help="jobs for the engine-alone row")
    ap.add_argument("--cpu-kernels", action=argparse.BooleanOptionalAction, default=True,
                    help="the C++ CPU kernels, in the workers and the engine-alone row (the PyTorch "
                             "references' prefill attention grows with the batch squared: slow)")
    ap.add_argument("--max-seconds", type=float, default=0,
                        help="stop submitting after this long and finish the jobs submitted (0 = no limit): "
                             "the table then reports the jobs that were submitted")
    ap.add_argument("--quick", action="store_true", help="2,000 jobs, 500 engine jobs, no doc (smoke)")
    ap.add_argument("--log-dir", default="", help="where the workers' logs go (default: a temp dir)")
    args = ap.parse_args()
    if args.quick:
        args.jobs, args.engine_jobs, args.chunk, args.no_write = 2_000, 500, 500, True

    from testbed.tiny_models import make_tiny_model

    work = tempfile.mkdtemp(prefix="bench-million-")
    log_dir = args.log_dir or work
    model_dir = make_tiny_model(os.path.join(work, "model"), "llama", rope_scaling=None)
    print(f"engine alone: {args.engine_jobs:,} jobs ...", flush=True)
    engine_seconds = engine_alone(model_dir, args.engine_jobs, args.max_num_seqs, args.cpu_kernels)
    print(f"  {args.engine_jobs / engine_seconds:,.0f} jobs/s", flush=True)
    print(f"whole system: {args.jobs:,} jobs, {args.workers} workers (logs in {log_dir}) ...", flush=True)
    run = run_system(args, model_dir, log_dir)
    run.engine_jobs, run.engine_seconds = args.engine_jobs, engine_seconds
    body = report(args, run)
    print(body)
    if not args.no_write:
        section = "### A million jobs end to end (`benchmarks/e2e/million_jobs.py`)\n\n" + body
        print("wrote", write_section("scaling.md", "bench_million_jobs", section))
    if run.failed or run.finished != run.jobs or not run.counter_ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
