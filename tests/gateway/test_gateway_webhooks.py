"""Batch-end webhooks: Standard Webhooks signatures, retried with backoff through 500s, one delivery each."""

from __future__ import annotations

import json
import time

import openai
import pytest
from standardwebhooks import Webhook, WebhookVerificationError

from tests.support.gateway_harness import WEBHOOK_SECRET, WebhookReceiver, chat_line, wait_until, write_jsonl


def test_each_ended_batch_gets_exactly_one_signed_delivery_after_transient_500s(gateway_stack, tmp_path):
    client = gateway_stack.openai("alice")
    src = write_jsonl(tmp_path / "in.jsonl", [chat_line(f"r{i}", "Hi", max_tokens=2) for i in range(2)])
    file_id = client.files.create(file=src.open("rb"), purpose="batch").id
    with WebhookReceiver(fail_first=2) as hooks:
        made = {status: client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                              completion_window="24h", extra_body={"webhook_url": hooks.url})
                for status in ("completed", "cancelled")}
        assert made["completed"].webhook_url == hooks.url
        client.batches.cancel(made["cancelled"].id)
        for status, batch in made.items():
            assert gateway_stack.wait_batch(client, batch.id).status == status
        wait_until(lambda: len(hooks.delivered()) >= 2, 60, "both deliveries", list(gateway_stack.procs.values()),
                   every=0.1)
        time.sleep(4.5)  # two retry intervals: a duplicate delivery would have come by now
        attempts = list(hooks.attempts)

    with gateway_stack.http("alice") as http:
        secret = http.get("/v1/webhook_secret").json()["secret"]  # alice's own, derived from WEBHOOK_SECRET
    assert secret != WEBHOOK_SECRET
    verifier = Webhook(secret)
    by_batch: dict[str, list[dict]] = {}
    for attempt in attempts:
        event = verifier.verify(attempt["body"], attempt["headers"])  # raises unless the signature is right
        assert attempt["headers"]["content-type"] == "application/json"
        by_batch.setdefault(event["data"]["id"], []).append(attempt | {"event": event})
    assert set(by_batch) == {b.id for b in made.values()}
    for status, batch in made.items():
        tries = by_batch[batch.id]
        assert [t["status"] for t in tries] == [500, 500, 200], "two failures, then exactly one delivery"
        assert len({t["headers"]["webhook-id"] for t in tries}) == 1, "one message id across retries"
        assert len({t["body"] for t in tries}) == 1
        stamps = [int(t["headers"]["webhook-timestamp"]) for t in tries]
        # The harness's backoff is 2 s; RQ's scheduler works in whole seconds, so a gap is at least ~1 s.
        gaps = [b["at"] - a["at"] for a, b in zip(tries, tries[1:], strict=False)]
        assert stamps == sorted(stamps) and min(gaps) >= 0.9, f"backoff between attempts: {gaps}"
        event = tries[-1]["event"]
        assert event["type"] == f"batch.{status}" and event["object"] == "event"
        final = client.batches.retrieve(batch.id)
        assert event["data"]["status"] == status and event["data"]["output_file_id"] == final.output_file_id
        tampered = tries[-1]["body"].replace(b'"status"', b'"Status"')
        with pytest.raises(WebhookVerificationError):
            verifier.verify(tampered, tries[-1]["headers"])


def test_webhook_url_is_checked_at_create(gateway_stack, tmp_path):
    client = gateway_stack.openai("bob")
    src = write_jsonl(tmp_path / "in.jsonl", [chat_line("r", "Hi", max_tokens=1)])
    file_id = client.files.create(file=src.open("rb"), purpose="batch").id
    for url in ("ftp://example.com/hook", "not a url"):
        with pytest.raises(openai.BadRequestError) as err:
            client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h",
                                  extra_body={"webhook_url": url})
        assert err.value.param == "webhook_url"
    for field, value in (("completion_window", "1h"), ("endpoint", "/v1/embeddings"), ("endpoint", "/v1/completions")):
        with pytest.raises(openai.BadRequestError) as err:
            client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h",
                                  extra_body={field: value})
        assert err.value.param == field
    payload = json.dumps({"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h",
                          "priority": "high"})
    with gateway_stack.http("bob") as http:
        resp = http.post("/v1/batches", content=payload, headers={"content-type": "application/json"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "priority"


def test_a_webhook_that_never_succeeds_ends_in_rq_failed_registry(redis_server, tmp_path):
    """Retries run out -> RQ's failed-job registry (what `rq info` shows and `rq requeue` retries)."""
    from rq.registry import FailedJobRegistry

    from gateway import tasks
    from gateway.batches.records import GatewayBatch
    from gateway.context import GatewayContext
    from gateway.enqueue import enqueue_webhook
    from gateway.settings import GatewaySettings
    from gateway.tasks_worker import TasksWorker

    settings = GatewaySettings(redis_url=redis_server.url, api_keys="k", files_dir=tmp_path,
                               webhook_secret=WEBHOOK_SECRET, webhook_retry_intervals="0,0",
                               webhook_allow_networks="127.0.0.0/8")
    ctx = GatewayContext(settings)
    tasks.set_context(ctx)
    try:
        with WebhookReceiver(fail_first=100) as hooks:
            gw = GatewayBatch(id="batch_doomed", owner="key_x", input_file_id="file-x", endpoint="/v1/completions",
                              completion_window="24h", created_at=1.0, expires_at=2.0, final_status="completed",
                              ended_at=1.5, total=0, completed=0, failed=0, webhook_url=hooks.url)
            ctx.redis.hset(ctx.gkeys.batch(gw.id), mapping=gw.fields())
            assert enqueue_webhook(ctx, gw) and not enqueue_webhook(ctx, gw)  # queued once only
            TasksWorker([ctx.webhook_queue], connection=ctx.rq_redis).work(burst=True)
            assert [a["status"] for a in hooks.attempts] == [500, 500, 500]  # the first try and two retries
        assert FailedJobRegistry(queue=ctx.webhook_queue).get_job_ids() == ["webhook-batch_doomed"]
        record = ctx.redis.hgetall(ctx.gkeys.batch(gw.id))
        assert record["webhook_attempts"] == "3" and "answered 500" in record["webhook_last_error"]
        assert "webhook_delivered_at" not in record
    finally:
        tasks.set_context(None)
        ctx.close()
