"""The webhook task's work: one attempt at delivering a batch's end event (`batch.completed` ...), signed with
the owner's secrets; RQ retries it on the webhooks' own queue (tasks.py) until it is answered 2xx."""

from __future__ import annotations

import hashlib
import json
import time

import structlog

from gateway.batches.records import GatewayBatch, batch_object
from gateway.context import GatewayContext
from gateway.webhooks.delivery import deliver, parse_networks
from gateway.webhooks.secrets import signing_secrets

log = structlog.get_logger("tokenbus.gateway")


def event_id(batch_id: str) -> str:
    """The webhook-id of a batch's end event: the same on every attempt, so receivers can dedupe."""
    return "msg_" + hashlib.sha256(f"{batch_id}:ended".encode()).hexdigest()[:24]


def deliver_batch_event(ctx: GatewayContext, batch_id: str) -> int:
    """One attempt at the batch's webhook; raising makes RQ retry it after the next backoff interval."""
    gw = GatewayBatch.load(ctx.redis, ctx.gkeys, batch_id)
    raw = ctx.redis.hmget(ctx.gkeys.batch(batch_id), "webhook_delivered_at")
    if gw is None or not gw.webhook_url or raw[0]:
        return 0
    data = batch_object(gw, None)
    event = {"id": event_id(batch_id), "object": "event", "type": f"batch.{gw.final_status}",
             "created_at": int(gw.ended_at or time.time()), "data": data}
    key = ctx.gkeys.batch(batch_id)
    attempt = ctx.redis.hincrby(key, "webhook_attempts", 1)
    try:
        s = ctx.settings
        status = deliver(gw.webhook_url, signing_secrets(s.webhook_secret, s.webhook_previous_secret, gw.owner),
                         event["id"], json.dumps(event), timeout_s=s.webhook_timeout_s,
                         allowed=parse_networks(s.webhook_allow_networks))
    except Exception as err:
        ctx.redis.hset(key, "webhook_last_error", str(err)[:500])
        log.warning("webhook_attempt_failed", batch_id=batch_id, attempt=attempt, error=str(err)[:200])
        raise
    ctx.redis.hset(key, mapping={"webhook_delivered_at": time.time(), "webhook_last_error": ""})
    log.info("webhook_delivered", batch_id=batch_id, attempt=attempt, status=status)
    return status
