"""`tokenbus-worker` / `python -m worker`: load the model once, then serve jobs from Redis until SIGTERM."""

from __future__ import annotations

import os
import signal
import sys

import redis
import structlog

from producer.redaction import redact_url, scrub
from worker.logging import configure_logging
from worker.settings import WorkerSettings, load_settings


def engine_options(settings: WorkerSettings) -> dict:
    options = {
        "device": settings.device,
        "dtype": settings.dtype,
        "block_size": settings.block_size,
        "max_num_seqs": settings.max_num_seqs,
        "max_num_batched_tokens": settings.max_num_batched_tokens,
        "gpu_memory_utilization": settings.gpu_memory_utilization,
    }
    if settings.kv_cache_gb is not None:
        options["kv_cache_gb"] = settings.kv_cache_gb
    return options


def main(argv: list[str] | None = None) -> int:
    settings = load_settings(argv)
    configure_logging(settings.log_level, settings.log_json)
    log = structlog.get_logger("tokenbus.worker")
    # Until the serve loop installs its drain handler nothing is held: a SIGTERM just ends the process.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    log.info("worker_starting", **settings.model_dump(exclude={"redis_url"}),
             redis=redact_url(settings.redis_url))

    try:
        client = redis.Redis.from_url(
            settings.redis_url, socket_timeout=10, socket_connect_timeout=3, health_check_interval=15
        )
    except ValueError as err:
        log.error("bad_redis_url", url=redact_url(settings.redis_url), error=scrub(str(err), settings.redis_url))
        return 2

    # read from the environment by kernels/cpu.py and worker/loader.py, which the offline Engine also uses
    os.environ["TOKENBUS_CPU_KERNELS"] = "1" if settings.cpu_kernels else "0"
    if settings.cache_dir:
        os.environ["TOKENBUS_CACHE_DIR"] = settings.cache_dir
    from worker.engine import Engine  # torch: imported after the cheap checks
    from worker.metrics import WorkerMetrics
    from worker.serve import Server

    metrics = WorkerMetrics(model=settings.model, worker=settings.worker_name)
    if settings.metrics_port:
        port = metrics.start_http(settings.metrics_port)
        log.info("metrics_listening", port=port)
    try:
        engine = Engine(settings.model, **engine_options(settings))
    except (ValueError, OSError) as err:
        log.error("engine_load_failed", model=settings.model, error=str(err))
        metrics.stop_http()
        return 2
    server = Server(settings, engine, client, metrics)
    server.install_signal_handlers()
    try:
        return server.run()
    finally:
        metrics.stop_http()


if __name__ == "__main__":
    sys.exit(main())
