"""Queueing the gateway's RQ jobs (the functions live in tasks.py, named by path so this module does not
import them): called by the app, the watcher, batches/ingest.py and the tasks themselves. Each is keyed by the
batch id, so a second enqueue never duplicates work."""

from __future__ import annotations

import time

from rq import Retry

from gateway.batches.records import GatewayBatch
from gateway.context import GatewayContext

TASKS = "gateway.tasks"


def enqueue_submit(ctx: GatewayContext, batch_id: str) -> None:
    ctx.queue.enqueue(f"{TASKS}.submit_batch", batch_id, job_id=f"submit-{batch_id}",
                      retry=Retry(max=3, interval=[2, 10, 60]), job_timeout=6 * 3600, result_ttl=3600,
                      failure_ttl=30 * 86400)


def enqueue_finalize(ctx: GatewayContext, batch_id: str) -> bool:
    """Queue the finalisation once per batch (HSETNX is the guard); False when it already was."""
    if not ctx.redis.hsetnx(ctx.gkeys.batch(batch_id), "finalize_enqueued_at", time.time()):
        return False
    ctx.queue.enqueue(f"{TASKS}.finalize_batch", batch_id, job_id=f"finalize-{batch_id}",
                      retry=Retry(max=5, interval=[2, 10, 60, 300, 900]), job_timeout=6 * 3600,
                      result_ttl=3600, failure_ttl=30 * 86400)
    return True


def enqueue_webhook(ctx: GatewayContext, gw: GatewayBatch) -> bool:
    """Queue the batch's one webhook event (when it has a webhook_url) on the webhooks' own queue; HSETNX
    makes it once per batch."""
    if not gw.webhook_url or not ctx.redis.hsetnx(ctx.gkeys.batch(gw.id), "webhook_enqueued_at", time.time()):
        return False
    intervals = ctx.settings.retry_intervals
    # job_timeout: a backstop only; deliver() keeps every attempt within webhook_timeout_s.
    ctx.webhook_queue.enqueue(f"{TASKS}.deliver_batch_webhook", gw.id, job_id=f"webhook-{gw.id}",
                              retry=Retry(max=len(intervals), interval=intervals),
                              job_timeout=int(ctx.settings.webhook_timeout_s) + 30, result_ttl=86400,
                              failure_ttl=30 * 86400)
    return True
