"""`tokenbus exporter`: the jobs waiting per model and priority as Prometheus text, from a process that runs while
no worker does.

An autoscaler that scales workers from zero (KEDA's Prometheus scaler, deploy/kubernetes/) cannot read the
backlog from a worker's /metrics when there is no worker, so this small process serves it, read from Redis at
each scrape:

    tokenbus_jobs_waiting{model, priority}   queued, not delivered to any worker yet
    tokenbus_jobs_pending{model, priority}   delivered to a worker and not acknowledged (held: running or on
                                             its way into an engine, or held by a dead worker until reclaimed)

Every declared model has its series (`model` = its id, protocol/registry.py); the default queues' jobs count for
the default model, whose workers serve them (for `--model` while no model is declared). The counts are recounted
from the queues (protocol.scripts.queue_counts, O(live batches) per scrape) because the depth counter does not
split `pending` by priority.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import redis
import structlog

from protocol import model_status, scripts
from protocol.keys import Keys
from protocol.metrics_http import NOT_FOUND, TEXT, MetricsHandler

log = structlog.get_logger("tokenbus.exporter")

DEFAULT_PORT = 9401  # the worker's metrics port is 9400
WAITING = "tokenbus_jobs_waiting"
PENDING = "tokenbus_jobs_pending"
HELP = {
    WAITING: "Jobs queued and not yet delivered to any worker, by model and priority.",
    PENDING: "Jobs delivered to a worker and not yet acknowledged, by model and priority.",
}
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


Counts = dict[str, tuple[int, int]]  # priority -> (depth, pending): scripts.queue_counts


def model_counts(r: redis.Redis, keys: Keys, model: str) -> dict[str, Counts]:
    """model label -> its counts: each declared model's queues under its id, and the default queues under the
    default model's (its workers serve them), or `model` while none is declared."""
    labelled = [(model_status.default_model(r, keys) or model, ""),
                *((mid, mid) for mid in model_status.declared(r, keys))]
    out: dict[str, Counts] = {}
    for label, mid in labelled:
        counts, prev = scripts.queue_counts(r, keys.for_model(mid)), out.get(label)
        out[label] = counts if prev is None else {p: (prev[p][0] + d, prev[p][1] + q) for p, (d, q) in counts.items()}
    return out


def render(counts: Counts, model: str) -> str:
    """Prometheus text of queue_counts' priority -> (depth, pending), every series labelled with `model`."""
    return render_models({model: counts})


def render_models(per_model: dict[str, Counts]) -> str:
    """Prometheus text of every model's counts (model_counts)."""
    lines: list[str] = []
    for name, pick in ((WAITING, lambda d, p: max(0, d - p)), (PENDING, lambda d, p: p)):
        lines += [f"# HELP {name} {HELP[name]}", f"# TYPE {name} gauge"]
        lines += [f'{name}{{model="{_label(model)}",priority="{_label(priority)}"}} {pick(depth, pending)}'
                  for model, counts in per_model.items() for priority, (depth, pending) in counts.items()]
    return "\n".join(lines) + "\n"


def _handler_for(read: Callable[[], str]) -> type[BaseHTTPRequestHandler]:
    class Handler(MetricsHandler):
        def do_GET(self) -> None:
            path = self.route
            if path not in ("/metrics", "/healthz"):
                self.send_body(404, TEXT, NOT_FOUND)
                return
            try:
                body = read()
            except redis.RedisError as err:
                # a scrape error, not zeros: an autoscaler must not read an outage as an empty queue
                log.warning("exporter_redis_error", error=str(err))
                self.send_body(503, TEXT, f"redis unavailable: {err}\n".encode())
                return
            if path == "/healthz":
                self.send_body(200, "application/json", b'{"status": "ok"}')
            else:
                self.send_body(200, CONTENT_TYPE, body.encode())

    return Handler


def make_server(r: redis.Redis, keys: Keys, model: str, port: int = DEFAULT_PORT,
                addr: str = "0.0.0.0") -> ThreadingHTTPServer:
    """The HTTP server of /metrics and /healthz, bound and not yet serving."""
    server = ThreadingHTTPServer((addr, port), _handler_for(lambda: render_models(model_counts(r, keys, model))))
    server.daemon_threads = True
    return server


def serve(r: redis.Redis, keys: Keys, model: str, port: int = DEFAULT_PORT, addr: str = "0.0.0.0") -> int:
    """Serve /metrics and /healthz until SIGTERM or SIGINT."""
    server = make_server(r, keys, model, port, addr)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    thread = threading.Thread(target=server.serve_forever, name="exporter-http", daemon=True)
    thread.start()
    # warning: the CLI logs warnings and up
    log.warning("exporter_ready", port=server.server_address[1], namespace=keys.ns, model=model)
    stop.wait()
    server.shutdown()
    server.server_close()
    return 0
