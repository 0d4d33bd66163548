"""RQ jobs of the gateway: submit a batch's file, finalise an ended batch, deliver its webhook.

They run in `tokenbus-gateway tasks` (tasks_worker.py), on the RQ queue `{namespace}-gateway` in the same
Redis; webhook deliveries on their own queue `{namespace}-gateway-webhooks`, worked by `tokenbus-gateway
webhooks`, so a slow receiver never delays a submit or a finalisation. Each is idempotent and keyed by
the batch id (RQ job ids `submit-`, `finalize-`, `webhook-{batch}`), so a retry or a second enqueue never
duplicates jobs, files or deliveries. Failures retry with RQ's Retry and backoff; what still fails lands
in RQ's failed-job registry (`rq info`, `rq requeue`).

RQ stores each job by this module's path and function name (enqueue.py), so the names here stay put when
the work moves: the work is in batches/submit.py, batches/finalise.py and webhooks/task.py.
"""

from __future__ import annotations

from gateway.batches import finalise, submit
from gateway.context import GatewayContext
from gateway.settings import GatewaySettings
from gateway.webhooks import task as webhook_task

_CTX: GatewayContext | None = None


def context() -> GatewayContext:
    """The tasks process's context, built once from the environment (RQ passes only the batch id)."""
    global _CTX
    if _CTX is None:
        _CTX = GatewayContext(GatewaySettings())
    return _CTX


def set_context(ctx: GatewayContext | None) -> None:
    global _CTX
    _CTX = ctx


def submit_batch(batch_id: str) -> str:
    """Write the batch's jobs (batches/submit.py)."""
    return submit.submit(context(), batch_id)


def finalize_batch(batch_id: str) -> str:
    """Ended batch -> output file + error file (batches/finalise.py)."""
    return finalise.finalize(context(), batch_id)


def deliver_batch_webhook(batch_id: str) -> int:
    """One attempt at the batch's webhook (webhooks/task.py); raising makes RQ retry it."""
    return webhook_task.deliver_batch_event(context(), batch_id)
