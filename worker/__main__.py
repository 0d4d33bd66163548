"""`tokenbus-worker` / `python -m worker`: load the model once, then serve jobs from Redis until SIGTERM."""

from __future__ import annotations

import signal
import sys
import time

import redis
import structlog
from pydantic import ValidationError
from redis.exceptions import RedisClusterException

from protocol.connection import redis_from_url
from protocol.logs import configure_logging
from protocol.redaction import redact_url, scrub
from worker.settings import load_settings


def main(argv: list[str] | None = None) -> int:
    try:
        settings = load_settings(argv)
    except ValidationError as err:  # before logging is set up: say it plainly
        print(f"tokenbus-worker: invalid settings: {err}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level, settings.log_json)
    log = structlog.get_logger("tokenbus.worker")
    # Until the serve loop installs its drain handler nothing is held: a SIGTERM just ends the process.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    log.info("worker_starting", **settings.model_dump(exclude={"redis_url"}),
             redis=redact_url(settings.redis_url))

    while True:
        try:
            client = redis_from_url(
                settings.redis_url, socket_timeout=10, socket_connect_timeout=3, health_check_interval=15
            )
            break
        except ValueError as err:
            log.error("bad_redis_url", url=redact_url(settings.redis_url), error=scrub(str(err), settings.redis_url))
            return 2
        except (redis.RedisError, RedisClusterException, OSError) as err:
            # Only a cluster client dials when made (it maps the slots): wait for the cluster as for any outage.
            log.warning("redis_unavailable", during="connect", error=scrub(str(err), settings.redis_url))
            time.sleep(2)

    from worker.engine import Engine  # torch: imported after the cheap checks
    from worker.serve.metrics import WorkerMetrics
    from worker.serve.server import Server

    metrics = WorkerMetrics(model=settings.engine.model, worker=settings.worker_name)
    if settings.metrics_port:
        port = metrics.start_http(settings.metrics_port)
        log.info("metrics_listening", port=port)
    try:
        engine = Engine(settings.engine)
    except (ValueError, OSError) as err:
        log.error("engine_load_failed", model=settings.engine.model, error=str(err))
        metrics.stop_http()
        return 2
    server = Server(settings, engine, client, metrics)
    server.install_signal_handlers()
    try:
        return server.run()
    finally:
        engine.close()  # a tensor-parallel engine's other ranks stop once its jobs are drained
        metrics.stop_http()


if __name__ == "__main__":
    sys.exit(main())
