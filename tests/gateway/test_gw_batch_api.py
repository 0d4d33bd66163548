"""The Batch API as clients use it today, through the official Python SDK against the light stack (real Redis
and gateway processes; jobs ended as a worker ends them): /v1/responses batches and their usage, batch.model,
output_expires_after, Idempotency-Key replays, retry of what failed, OpenAI's endpoint list, and one verified
webhook event per ended batch (client.webhooks.unwrap)."""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import openai
import pytest

from testbed.light_gateway import LightStack, chat_line, wait_until, write_jsonl
from tests.support.gateway_harness import WebhookReceiver

SERVED = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


def responses_line(cid: str, text: str, **body) -> str:
    body = {"model": "smollm2-135m", "input": text, "instructions": "Answer briefly.",
            "max_output_tokens": 8} | body
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/responses", "body": body})


def make_batch(stack: LightStack, tmp_path, lines: list[str], endpoint: str = "/v1/chat/completions",
               who: str = "alice", **extra):
    client = stack.openai(who)
    src = write_jsonl(tmp_path / f"in-{time.monotonic_ns()}.jsonl", lines)
    fid = client.files.create(file=src.open("rb"), purpose="batch").id
    return client.batches.create(input_file_id=fid, endpoint=endpoint, completion_window="24h", **extra)


def submitted(stack: LightStack, batch_id: str) -> None:
    stack.wait_status("alice", batch_id, ("in_progress",))


def test_a_responses_batch_sums_its_usage_and_names_its_model(light_stack, tmp_path):
    b = make_batch(light_stack, tmp_path, [responses_line(f"r{i}", f"question {i}") for i in range(3)],
                   endpoint="/v1/responses")
    assert b.endpoint == "/v1/responses" and b.model == "smollm2-135m"
    assert b.usage.input_tokens == 0 and b.usage.total_tokens == 0
    submitted(light_stack, b.id)
    usages = [(20, 4, 16), (22, 3, 16), (21, 5, 0)]  # (prompt, completion, cached)
    light_stack.end_job(f"{b.id}-0", text="zero", usage=dict(zip(("prompt_tokens", "completion_tokens",
                                                                  "cached_tokens"), usages[0], strict=True)))
    client = light_stack.openai()
    mid = client.batches.retrieve(b.id)  # summed as lines end
    assert (mid.usage.input_tokens, mid.usage.output_tokens, mid.usage.input_tokens_details.cached_tokens) == \
        usages[0][:2] + (16,)
    for i in (1, 2):
        light_stack.end_job(f"{b.id}-{i}", text=f"answer {i}", usage={
            "prompt_tokens": usages[i][0], "completion_tokens": usages[i][1], "cached_tokens": usages[i][2],
            "total_tokens": usages[i][0] + usages[i][1]})
    done = light_stack.wait_status("alice", b.id, ("completed",))
    assert done.usage.input_tokens == 63 and done.usage.output_tokens == 12 and done.usage.total_tokens == 75
    assert done.usage.input_tokens_details.cached_tokens == 32
    lines = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    assert [x["custom_id"] for x in lines] == ["r0", "r1", "r2"]
    body = lines[1]["response"]["body"]
    assert body["object"] == "response" and body["status"] == "completed"
    assert body["output"][0]["content"][0] == {"type": "output_text", "text": "answer 1", "annotations": [],
                                               "logprobs": []}
    assert body["instructions"] == "Answer briefly." and body["max_output_tokens"] == 8
    assert body["usage"]["input_tokens"] == 22 and body["usage"]["input_tokens_details"]["cached_tokens"] == 16
    with httpx.Client(base_url=light_stack.base_url) as ui:  # the dashboard shows the same counts
        token = re.search(r'name="login_token" value="([^"]+)"', ui.get("/ui/login").text).group(1)
        ui.post("/ui/login", data={"api_key": client.api_key, "login_token": token})
        page = ui.get(f"/ui/batches/{b.id}?fragment=1").text
    assert re.search(r"63 in \(32\s+cached\), 12 out, 75 in all", page), page


def test_unserved_endpoints_are_refused_with_the_served_list(light_stack, tmp_path):
    client = light_stack.openai()
    src = write_jsonl(tmp_path / "in.jsonl", [chat_line("a", "hi")])
    fid = client.files.create(file=src.open("rb"), purpose="batch").id
    for endpoint in ("/v1/moderations", "/v1/images/generations", "/v1/videos", "/v1/not-an-endpoint"):
        with pytest.raises(openai.BadRequestError) as err:
            client.batches.create(input_file_id=fid, endpoint=endpoint, completion_window="24h")
        assert err.value.code == "unsupported_endpoint"
        assert all(s in err.value.message for s in SERVED), err.value.message


def test_responses_lines_refuse_what_is_not_served_naming_the_field(light_stack, tmp_path):
    lines = [responses_line("tools", "x", tools=[{"type": "function", "name": "f"}]),
             responses_line("image", [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}])]
    b = make_batch(light_stack, tmp_path, lines, endpoint="/v1/responses")
    failed = light_stack.wait_status("alice", b.id, ("failed",))
    messages = [e.message for e in failed.errors.data]
    assert "body.tools" in messages[0] and "body.input.0.content.0" in messages[1], messages


def test_output_files_expire_after_output_expires_after(light_stack, tmp_path):
    b = make_batch(light_stack, tmp_path, [chat_line("a", "hi"), chat_line("b", "hi")],
                   extra_body={"output_expires_after": {"anchor": "created_at", "seconds": 2}})
    submitted(light_stack, b.id)
    light_stack.end_job(f"{b.id}-0")
    light_stack.end_job(f"{b.id}-1", error_code="worker_error")
    client = light_stack.openai()
    done = light_stack.wait_status("alice", b.id, ("completed",))
    out = client.files.retrieve(done.output_file_id)
    assert out.expires_at is not None and out.expires_at - out.created_at <= 3
    assert client.files.content(done.error_file_id).text  # readable until then
    r = light_stack.r()
    # (the list of expiring files also holds other batches' files: they go with their batches, in 30 days)
    files = [f"{{tokenbus}}:gw:file:{fid}" for fid in (done.output_file_id, done.error_file_id)]
    wait_until(lambda: not any(r.exists(f) for f in files), 10, "the watcher's sweep", light_stack.all(), every=0.2)
    assert not [m for m in r.zrange("{tokenbus}:gw:expiring-files", 0, -1)
                if m.endswith((done.output_file_id, done.error_file_id))], "their entries went too"
    for fid in (done.output_file_id, done.error_file_id):
        with pytest.raises(openai.NotFoundError):
            client.files.content(fid)
        with pytest.raises(openai.NotFoundError):
            client.files.retrieve(fid)
    with pytest.raises(openai.BadRequestError) as err:  # 30 days at most
        client.batches.create(input_file_id=b.input_file_id, endpoint="/v1/chat/completions",
                              completion_window="24h",
                              extra_body={"output_expires_after": {"anchor": "created_at", "seconds": 31 * 86400}})
    assert err.value.param == "output_expires_after.seconds"


def test_idempotency_key_replays_the_first_object(light_stack, tmp_path):
    client, bob = light_stack.openai(), light_stack.openai("bob")
    src = write_jsonl(tmp_path / "in.jsonl", [chat_line("a", "hi")])
    other = write_jsonl(tmp_path / "other.jsonl", [chat_line("a", "bye")])
    key = {"Idempotency-Key": f"upload-{time.monotonic_ns()}"}
    first = client.files.create(file=src.open("rb"), purpose="batch", extra_headers=key)
    again = client.files.create(file=src.open("rb"), purpose="batch", extra_headers=key)
    assert again.id == first.id
    with pytest.raises(openai.ConflictError) as err:
        client.files.create(file=other.open("rb"), purpose="batch", extra_headers=key)
    assert err.value.code == "idempotency_key_reused"
    assert bob.files.create(file=src.open("rb"), purpose="batch", extra_headers=key).id != first.id  # per key

    create = {"input_file_id": first.id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    bkey = {"Idempotency-Key": f"batch-{time.monotonic_ns()}"}
    # two first requests at once: one batch, the other request gets it or a 409 saying to retry
    results: list = []

    def post() -> None:
        try:
            results.append(client.batches.create(**create, extra_headers=bkey).id)
        except openai.ConflictError as e:
            results.append(e.code)

    threads = [threading.Thread(target=post) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    made = {x for x in results if x.startswith("batch_")}
    assert len(made) == 1 and set(results) <= made | {"idempotency_key_in_use"}, results
    (batch_id,) = made
    assert client.batches.create(**create, extra_headers=bkey).id == batch_id
    with pytest.raises(openai.ConflictError):
        client.batches.create(**create, metadata={"x": "y"}, extra_headers=bkey)
    r = light_stack.r()
    stored = [k for k in r.scan_iter("{tokenbus}:gw:idem:*")]
    assert stored and all(0 < r.ttl(k) <= 86400 and len(r.get(k)) < 80 for k in stored)
    client.batches.cancel(batch_id)  # the shared stack's later tests find no batch of this one open
    light_stack.wait_status("alice", batch_id, ("cancelled",))


def test_retry_batch_reruns_the_failed_lines_and_links_both_ways(light_stack, tmp_path):
    lines = [chat_line(f"c{i}", f"q{i}") for i in range(4)]
    b = make_batch(light_stack, tmp_path, lines)
    submitted(light_stack, b.id)
    light_stack.end_job(f"{b.id}-0")
    light_stack.end_job(f"{b.id}-2", error_code="worker_error")
    light_stack.end_job(f"{b.id}-3")
    client = light_stack.openai()
    with httpx.Client(base_url=light_stack.base_url, headers={"authorization": f"Bearer {client.api_key}"}) as h:
        early = h.post(f"/v1/batches/{b.id}/retry")
        assert early.status_code == 409 and early.json()["error"]["code"] == "batch_not_retryable"
        client.batches.cancel(b.id)  # line 1 never ran
        light_stack.wait_status("alice", b.id, ("cancelled",))
        retry = h.post(f"/v1/batches/{b.id}/retry").json()
        assert retry["retry_of"] == b.id and retry["request_counts"]["total"] == 2
        assert client.batches.retrieve(b.id).model_extra["retried_by"] == retry["id"]
        twice = h.post(f"/v1/batches/{b.id}/retry")
        assert twice.status_code == 409
    submitted(light_stack, retry["id"])
    for i in range(2):
        light_stack.end_job(f"{retry['id']}-{i}", text=f"again {i}")
    done = light_stack.wait_status("alice", retry["id"], ("completed",))
    out = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    assert [x["custom_id"] for x in out] == ["c1", "c2"] and done.error_file_id is None


def test_one_verified_webhook_event_per_ended_batch(light_stack, tmp_path):
    client = light_stack.openai()
    secret = light_stack.http().get("/v1/webhook_secret").json()["secret"]
    with WebhookReceiver(fail_first=0) as hooks:
        hook = {"webhook_url": hooks.url}
        completed = make_batch(light_stack, tmp_path, [chat_line("a", "hi")], extra_body=hook)
        failed = make_batch(light_stack, tmp_path, ["not json"], extra_body=hook)
        cancelled = make_batch(light_stack, tmp_path, [chat_line("a", "hi")], extra_body=hook)
        expired = make_batch(light_stack, tmp_path, [chat_line("a", "hi")], extra_body=hook)
        for b in (completed, cancelled, expired):
            submitted(light_stack, b.id)
        light_stack.end_job(f"{completed.id}-0")
        client.batches.cancel(cancelled.id)
        light_stack.r().hset(f"{{tokenbus}}:gw:batch:{expired.id}", "expires_at", time.time() - 1)
        made = {"completed": completed, "failed": failed, "cancelled": cancelled, "expired": expired}
        for status, b in made.items():
            light_stack.wait_status("alice", b.id, (status,))
        wait_until(lambda: len(hooks.delivered()) >= 4, 20, "four deliveries", light_stack.all(), every=0.1)
        time.sleep(2.5)  # the harness's retry interval: a second delivery would have come by now
        attempts = list(hooks.attempts)
    events = [client.webhooks.unwrap(a["body"].decode(), a["headers"], secret=secret) for a in attempts]
    assert sorted((e.type, e.data.id) for e in events) == sorted((f"batch.{s}", b.id) for s, b in made.items())
    with pytest.raises(openai.InvalidWebhookSignatureError):
        client.webhooks.unwrap(attempts[0]["body"].decode().replace("batch", "Batch"), attempts[0]["headers"],
                               secret=secret)
