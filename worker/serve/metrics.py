"""Prometheus metrics and the /healthz endpoint of one worker process.

The serve loop owns one `WorkerMetrics` and calls, from any thread:

    metrics = WorkerMetrics(model="smollm2-135m", worker="gpu-box-1", stale_after_s=30.0)
    metrics.start_http(port)           # GET /metrics (Prometheus text), GET /healthz (JSON, 200 or 503)
    metrics.job_started()              # a job left the queue and entered the engine
    metrics.job_finished(status, reason, latency_s, ttft_s, generated_tokens)
                                       # status "finished" | "failed" | "cancelled"; reason = finish_reason
                                       # ("stop", "length", "abort") or the failure's reason
    metrics.observe_step(step_s, running, waiting, used_blocks, free_blocks, preemptions_total)
    metrics.observe_engine(running, waiting, used_blocks, free_blocks)   # the gauges alone, between steps
    metrics.observe_queue(depth, pending)   # stream length; the group's delivered-but-unacked count
    metrics.observe_priorities({"interactive": 3, "bulk": 2})   # jobs this worker holds, per priority
    metrics.observe_models(infos)      # every model of the namespace (protocol.records.ModelInfo)
    metrics.observe_prefix_cache(queried_tokens, hit_tokens, queried_blocks, hit_blocks, cached_blocks)
                                       # the engine's cumulative prefix-cache counts (EngineStats)
    metrics.heartbeat()                # "the loop is alive" while idle (observe_step beats too)
    metrics.stop_http()

/healthz answers 503 "starting" until the first beat (the model is still loading), 200 "ok" while the last
beat is at most `stale_after_s` old, and 503 "stale" after that (a hung step or a dead loop thread), so
Docker's HEALTHCHECK and an orchestrator can tell a wedged worker from a busy one.

Every metric lives on the instance's own CollectorRegistry, never the global one, so tests and several
instances in one process do not collide.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.exposition import generate_latest

from protocol.metrics_http import NOT_FOUND, TEXT, MetricsHandler
from protocol.priority import PRIORITIES

# Prefill of a 1k-token prompt behind a full batch can take seconds on a small GPU; a CPU worker, minutes.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# A job's latency includes its wait inside the engine; bulk jobs of 1k tokens run for minutes on CPU.
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
# One engine step: a decode step of a small model is ~ms on a GPU; a chunked prefill on CPU is seconds.
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)

JOB_STATUSES = ("finished", "failed", "cancelled")


class WorkerMetrics:
    """The worker's Prometheus metrics plus liveness for /healthz. See the module docstring for the API."""

    def __init__(
        self,
        model: str = "",
        worker: str = "",
        stale_after_s: float = 30.0,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if stale_after_s <= 0:
            raise ValueError(f"stale_after_s must be > 0, got {stale_after_s}")
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.stale_after_s = stale_after_s
        self._clock = clock
        self._last_beat: float | None = None
        self._preemptions_seen = 0
        self._prefix_seen = (0, 0, 0, 0)
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._server_thread: threading.Thread | None = None

        r = self.registry
        self.info = Info("tokenbus_worker", "The model this worker serves and its name.", registry=r)
        self.info.info({"model": model, "worker": worker})
        self.jobs_started = Counter("tokenbus_jobs_started", "Jobs handed to the engine.", registry=r)
        self.jobs_finished = Counter(
            "tokenbus_jobs_finished", "Jobs that ended with a result, by finish reason.", ["reason"],
            registry=r,
        )
        self.jobs_failed = Counter(
            "tokenbus_jobs_failed", "Jobs that failed, by reason.", ["reason"], registry=r
        )
        self.jobs_cancelled = Counter("tokenbus_jobs_cancelled", "Jobs cancelled while running.", registry=r)
        self.generated_tokens = Counter(
            "tokenbus_generated_tokens", "Completion tokens of ended jobs.", registry=r
        )
        self.preemptions = Counter(
            "tokenbus_preemptions", "Sequences preempted for lack of KV blocks.", registry=r
        )
        self.running = Gauge("tokenbus_running_sequences", "Sequences in the running batch.", registry=r)
        self.waiting = Gauge("tokenbus_waiting_sequences", "Sequences waiting for a seat.", registry=r)
        self.kv_used = Gauge("tokenbus_kv_blocks_used", "KV cache blocks held by sequences.", registry=r)
        self.kv_free = Gauge("tokenbus_kv_blocks_free", "KV cache blocks on the free list.", registry=r)
        self.prefix_queried = Counter(
            "tokenbus_prefix_cache_queries", "Prompt tokens / full prompt blocks looked up in the prefix cache.",
            ["unit"], registry=r,
        )
        self.prefix_hits = Counter(
            "tokenbus_prefix_cache_hits", "Prompt tokens / blocks served from the prefix cache.", ["unit"],
            registry=r,
        )
        self.prefix_hit_rate = Gauge(
            "tokenbus_prefix_cache_hit_rate", "Share of looked-up prompt tokens / blocks found cached since the "
            "engine started.", ["unit"], registry=r,
        )
        self.prefix_cached_blocks = Gauge(
            "tokenbus_prefix_cache_blocks", "KV blocks holding a reusable prefix (in use or evictable).", registry=r
        )
        for unit in ("tokens", "blocks"):
            self.prefix_queried.labels(unit=unit)
            self.prefix_hits.labels(unit=unit)
            self.prefix_hit_rate.labels(unit=unit)
        self.queue_depth = Gauge("tokenbus_queue_depth", "Entries in the jobs stream.", registry=r)
        self.queue_pending = Gauge(
            "tokenbus_queue_pending", "Entries delivered to a worker and not yet acknowledged.", registry=r
        )
        # one series per priority, each present from the start: is interactive traffic crowding out batches?
        self.jobs_by_priority = Gauge("tokenbus_jobs_held", "Jobs this worker holds (leased: in the engine or "
                                      "in transit), by priority.", ["priority"], registry=r)
        for priority in PRIORITIES:
            self.jobs_by_priority.labels(priority=priority.value)
        # every model of the namespace, from each worker (an autoscaler takes max over workers): a model with
        # queued jobs and no live worker shows here too, through the workers of the other models
        self.model_jobs = Gauge("tokenbus_model_jobs", "Jobs in a model's queues of one priority: queued or "
                                "running (the model's depth counter); model '' = the default queues.",
                                ["model", "priority"], registry=r)
        self.model_pending = Gauge("tokenbus_model_jobs_pending", "Jobs of a model delivered to a worker and not "
                                   "yet ended.", ["model"], registry=r)
        self.model_workers = Gauge("tokenbus_model_workers", "Live workers serving a model.", ["model"], registry=r)
        self.model_unserved = Gauge("tokenbus_model_unserved", "1 while a model has jobs in its queues and no live "
                                    "worker.", ["model"], registry=r)
        self._models_seen: set[str] = set()
        self.last_beat = Gauge(
            "tokenbus_last_heartbeat_timestamp_seconds", "Unix time of the loop's last beat.", registry=r
        )
        self.ttft = Histogram(
            "tokenbus_time_to_first_token_seconds", "Job start to its first token.", buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.latency = Histogram(
            "tokenbus_job_latency_seconds", "Job start to its end.", buckets=LATENCY_BUCKETS, registry=r
        )
        self.step_time = Histogram(
            "tokenbus_step_seconds", "Wall time of one engine step.", buckets=STEP_BUCKETS, registry=r
        )
        # Labelled counters appear in /metrics only once a label is used; show the common ones at 0 so
        # rate() and alerts work from the first scrape.
        for reason in ("stop", "length"):
            self.jobs_finished.labels(reason=reason)

    # --- events from the serve loop ---------------------------------------------------------------

    def job_started(self) -> None:
        self.jobs_started.inc()

    def job_finished(
        self,
        status: str,
        reason: str,
        latency_s: float | None = None,
        ttft_s: float | None = None,
        generated_tokens: int = 0,
    ) -> None:
        """Count one ended job. `latency_s`/`ttft_s` are None when unknown (failed before any token)."""
        # Check everything before counting anything, so a bad call leaves the metrics as they were.
        if status not in JOB_STATUSES:
            raise ValueError(f"status must be one of {JOB_STATUSES}, got {status!r}")
        if generated_tokens < 0:
            raise ValueError(f"generated_tokens must be >= 0, got {generated_tokens}")
        if status == "finished":
            self.jobs_finished.labels(reason=reason).inc()
        elif status == "failed":
            self.jobs_failed.labels(reason=reason).inc()
        else:
            self.jobs_cancelled.inc()
        self.generated_tokens.inc(generated_tokens)
        if latency_s is not None:
            self.latency.observe(latency_s)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)

    def observe_step(
        self,
        step_s: float,
        running: int,
        waiting: int,
        used_blocks: int,
        free_blocks: int,
        preemptions_total: int,
    ) -> None:
        """Record one engine step. `preemptions_total` is the engine's cumulative count (EngineStats)."""
        self.step_time.observe(step_s)
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_used.set(used_blocks)
        self.kv_free.set(free_blocks)
        with self._lock:
            # A counter only goes up: feed it the delta. A smaller total means a new engine; start over.
            delta = preemptions_total - self._preemptions_seen
            if delta < 0:
                delta = preemptions_total
            self._preemptions_seen = preemptions_total
        if delta:
            self.preemptions.inc(delta)
        self.heartbeat()

    def observe_engine(self, running: int, waiting: int, used_blocks: int, free_blocks: int) -> None:
        """The engine's gauges outside a step (a cancel or an ending freed blocks while no step ran)."""
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_used.set(used_blocks)
        self.kv_free.set(free_blocks)

    def observe_prefix_cache(self, queried_tokens: int, hit_tokens: int, queried_blocks: int, hit_blocks: int,
                             cached_blocks: int) -> None:
        """The engine's cumulative prefix-cache counts: counters take the growth, gauges the rates."""
        totals = (queried_tokens, hit_tokens, queried_blocks, hit_blocks)
        with self._lock:
            seen = self._prefix_seen
            if any(t < s for t, s in zip(totals, seen, strict=True)):  # a new engine: start over
                seen = (0, 0, 0, 0)
            self._prefix_seen = totals
        deltas = [t - s for t, s in zip(totals, seen, strict=True)]
        for counter, unit, delta in ((self.prefix_queried, "tokens", deltas[0]), (self.prefix_hits, "tokens",
                                     deltas[1]), (self.prefix_queried, "blocks", deltas[2]),
                                     (self.prefix_hits, "blocks", deltas[3])):
            if delta:
                counter.labels(unit=unit).inc(delta)
        self.prefix_hit_rate.labels(unit="tokens").set(hit_tokens / queried_tokens if queried_tokens else 0.0)
        self.prefix_hit_rate.labels(unit="blocks").set(hit_blocks / queried_blocks if queried_blocks else 0.0)
        self.prefix_cached_blocks.set(cached_blocks)

    def observe_queue(self, depth: int, pending: int) -> None:
        self.queue_depth.set(depth)
        self.queue_pending.set(pending)

    def observe_models(self, infos: list[Any]) -> None:
        """Each model's jobs by priority, pending, live workers and unserved flag; a retired model's series go."""
        now = {m.id for m in infos}
        for gone in self._models_seen - now:
            for priority in PRIORITIES:
                self.model_jobs.remove(gone, priority.value)
            for gauge in (self.model_pending, self.model_workers, self.model_unserved):
                gauge.remove(gone)
        self._models_seen = now
        for m in infos:
            for priority in PRIORITIES:
                self.model_jobs.labels(model=m.id, priority=priority.value).set(m.by_priority.get(priority.value, 0))
            self.model_pending.labels(model=m.id).set(m.pending)
            self.model_workers.labels(model=m.id).set(m.workers)
            self.model_unserved.labels(model=m.id).set(int(m.unserved))

    def observe_priorities(self, held: dict[str, int]) -> None:
        for priority in PRIORITIES:
            self.jobs_by_priority.labels(priority=priority.value).set(held.get(priority.value, 0))

    def heartbeat(self) -> None:
        with self._lock:
            self._last_beat = self._clock()
        self.last_beat.set(time.time())

    # --- health -----------------------------------------------------------------------------------

    def health(self) -> tuple[bool, dict[str, object]]:
        """(healthy, details) as /healthz reports them."""
        with self._lock:
            last = self._last_beat
        if last is None:
            return False, {"status": "starting"}
        age = self._clock() - last
        status = "ok" if age <= self.stale_after_s else "stale"
        return status == "ok", {"status": status, "last_beat_age_s": round(age, 3),
                                "stale_after_s": self.stale_after_s}

    # --- HTTP -------------------------------------------------------------------------------------

    def start_http(self, port: int, addr: str = "0.0.0.0") -> int:
        """Serve /metrics and /healthz on a daemon thread; returns the bound port (0 picks a free one)."""
        if self._server is not None:
            raise RuntimeError("metrics HTTP server already running")
        self._server = ThreadingHTTPServer((addr, port), _handler_for(self))
        self._server.daemon_threads = True
        self._server_thread = threading.Thread(
            target=self._server.serve_forever, name="metrics-http", daemon=True
        )
        self._server_thread.start()
        return self._server.server_address[1]

    def stop_http(self) -> None:
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        if self._server_thread is not None:
            self._server_thread.join(timeout=5)
        self._server = None
        self._server_thread = None


def _handler_for(metrics: WorkerMetrics) -> type[BaseHTTPRequestHandler]:
    class Handler(MetricsHandler):
        def do_GET(self) -> None:
            if self.route == "/metrics":
                self.send_body(200, CONTENT_TYPE_LATEST, generate_latest(metrics.registry))
            elif self.route == "/healthz":
                healthy, details = metrics.health()
                self.send_body(200 if healthy else 503, "application/json", json.dumps(details).encode())
            else:
                self.send_body(404, TEXT, NOT_FOUND)

    return Handler
