"""`tokenbus-gateway tasks` (submits, finalisations, the batch watcher) and `tokenbus-gateway webhooks`
(deliveries): RQ workers on two queues, so a slow webhook receiver never delays a submit or a finalisation.

RQ's work loop quits on any unhandled error (e.g. Redis refusing its own writes when out of memory) and
returns as if it had finished. Here a worker that quits without a stop request is started again after a
backoff (tasks_restart_backoff_s); after that many quick failures in a row the process exits 1, so its
supervisor sees a failure (it used to exit 0 and leave every batch `validating`).

RQ 3's command listener (a pub/sub thread) waits up to 60 s for a message, and relies on its own unsubscribe
reply to wake it at shutdown; when that reply lands before the stop flag is cleared (a loaded machine), the
thread sleeps on, and redis-py 8's `stop()` waits it out: a SIGTERM took up to 60 s (15 s in the tests, then a
SIGKILL). TasksWorker listens in 1-second waits instead, so a stop ends within about a second.
"""

from __future__ import annotations

import signal
import threading
import time

import structlog
from rq import SimpleWorker

from gateway import tasks
from gateway.batches.watcher import BatchWatcher
from gateway.context import GatewayContext
from gateway.settings import GatewaySettings
from protocol.logs import configure_logging

log = structlog.get_logger("tokenbus.gateway")
HEALTHY_RUN_S = 300  # a worker that ran this long before failing resets the count of quick failures
LISTEN_WAIT_S = 1.0  # the longest a stop waits on the command listener


class TasksWorker(SimpleWorker):
    """RQ's SimpleWorker with a command listener that notices a stop within LISTEN_WAIT_S."""

    def subscribe(self) -> None:
        self.pubsub = self.connection.pubsub()
        self.pubsub.subscribe(**{self.pubsub_channel_name: self.handle_payload})
        self.pubsub_thread = self.pubsub.run_in_thread(sleep_time=LISTEN_WAIT_S, daemon=True,
                                                       exception_handler=self._pubsub_exception_handler)


def run_tasks(settings: GatewaySettings, burst: bool = False, webhooks: bool = False) -> int:
    configure_logging(settings.log_level, settings.log_json, libraries="info")
    ctx = GatewayContext(settings)
    tasks.set_context(ctx)  # the jobs use this process's settings (flags included), not a second parse
    ctx.files.root.mkdir(parents=True, exist_ok=True)
    queue = ctx.webhook_queue if webhooks else ctx.queue
    watcher = None if webhooks else BatchWatcher(ctx, settings.watch_interval_s).start()
    log.info("gateway_tasks_started", queue=queue.name, files_dir=str(settings.files_dir),
             namespace=settings.namespace)
    try:
        backoff = [float(x) for x in settings.tasks_restart_backoff_s.split(",")]
        return _work(ctx, queue, burst, settings.log_level.upper(), backoff)
    finally:
        if watcher is not None:
            watcher.stop()
        log.info("gateway_tasks_stopped", queue=queue.name)


def _work(ctx: GatewayContext, queue, burst: bool, level: str, backoff: list[float]) -> int:
    stop = threading.Event()
    failures = 0
    while True:
        # SimpleWorker runs each job in this process (no fork per job): the jobs are short and I/O-bound.
        # with_scheduler: retries with a backoff are scheduled jobs (each process schedules its own queue).
        started = time.monotonic()
        try:
            worker = TasksWorker([queue], connection=ctx.rq_redis)  # reads Redis: inside the try
            worker.work(with_scheduler=True, burst=burst, logging_level=level)
            # A SIGTERM/SIGINT (RQ's warm shutdown) sets the date; an error leaves it unset.
            if burst or worker._shutdown_requested_date is not None:
                return 0
            error = "the RQ worker quit (see its log line above)"
        except SystemExit:
            raise
        except Exception as err:  # e.g. Redis refusing the worker's registration when out of memory
            error = repr(err)
        if stop.is_set():
            return 0
        failures = 1 if time.monotonic() - started > HEALTHY_RUN_S else failures + 1
        if failures > len(backoff):
            log.error("gateway_tasks_giving_up", queue=queue.name, failures=failures - 1, error=error)
            return 1
        pause = backoff[failures - 1]
        log.warning("gateway_tasks_worker_restart", queue=queue.name, attempt=failures, backoff_s=pause,
                    error=error)
        # Between workers no RQ handler is installed: a SIGTERM now stops us cleanly instead.
        previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
        try:
            stop.wait(pause)
        finally:
            signal.signal(signal.SIGTERM, previous)
        if stop.is_set():
            return 0
