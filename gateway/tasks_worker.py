"""`tokenbus-gateway tasks`: the RQ worker for the gateway's queue plus the batch watcher thread.

One process does everything that happens without an HTTP request: submitting uploaded batches, noticing
ended ones (watcher.py), writing their output files and delivering webhooks (tasks.py). RQ's scheduler
runs along (with_scheduler) because retries with a backoff interval are scheduled jobs.
"""

from __future__ import annotations

import structlog
from rq import SimpleWorker

from gateway import tasks
from gateway.context import GatewayContext
from gateway.settings import GatewaySettings
from gateway.watcher import BatchWatcher
from protocol.logs import configure_logging

log = structlog.get_logger("tokenbus.gateway")


def run_tasks(settings: GatewaySettings, burst: bool = False) -> int:
    configure_logging(settings.log_level, settings.log_json, libraries="info")
    ctx = GatewayContext(settings)
    tasks.set_context(ctx)  # the jobs use this process's settings (flags included), not a second parse
    ctx.files.root.mkdir(parents=True, exist_ok=True)
    watcher = BatchWatcher(ctx, settings.watch_interval_s).start()
    # SimpleWorker runs each job in this process (no fork per job): the jobs are short and I/O-bound.
    worker = SimpleWorker([ctx.queue], connection=ctx.rq_redis)
    log.info("gateway_tasks_started", queue=settings.queue_name, files_dir=str(settings.files_dir),
             namespace=settings.namespace)
    try:
        worker.work(with_scheduler=True, burst=burst, logging_level=settings.log_level.upper())
    finally:
        watcher.stop()
        log.info("gateway_tasks_stopped")
    return 0
