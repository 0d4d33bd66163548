"""Issue #22 attacks 5-8 against the real deployment: costly constraints are refused at submit with a 400
naming the limit (and another tenant keeps its pace), one key's interactive load is capped (429) and cannot
starve another key's batch, and a key's priority comes from the gateway's configuration."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx

from tests.support.gateway_harness import KEYS, MODEL, chat_line, write_jsonl

HI = [{"role": "user", "content": "Say hello."}]


def test_costly_constraints_are_refused_at_submit_naming_the_limit(gateway_stack):
    """Attacks 5-7 over HTTP: refused at once (off the event loop) with a 400 naming the limit, so no grammar
    work reaches a worker; /healthz and another key's completion answer right after. The engine's own bound
    (a too costly mask fails that request alone) is tests/engine/test_constraint_costs.py, and the side-by-side
    timing of another request's 10 tokens is benchmarks/reliability/grammar_attack.py."""
    attacks = [({"regex": "a{100000}", "n": 4}, "max_repeat = 1000"),  # attack 6
               ({"choice": [f"item {i}" for i in range(2001)]}, "max_choice_count = 1000"),  # attack 7
               ({"choice": [f"{i:05d}" for i in range(6000)]}, "max_choice_count")]  # attack 5, within MAX_BODY
    with gateway_stack.http("alice") as alice:
        for extra, limit in attacks:
            t0 = time.monotonic()
            r = alice.post("/v1/chat/completions", json={"model": MODEL, "messages": HI, "max_tokens": 10} | extra)
            assert r.status_code == 400 and limit in r.json()["error"]["message"], r.text
            assert time.monotonic() - t0 < 5
    with httpx.Client(base_url=gateway_stack.base_url, timeout=10) as plain:
        assert plain.get("/healthz").status_code == 200
    reply = gateway_stack.openai("bob").chat.completions.create(model=MODEL, messages=HI, max_tokens=2,
                                                                temperature=0)
    assert reply.choices[0].message.content is not None


async def _hold(base_url: str, n: int, stop: threading.Event, counts: dict) -> None:
    """n loops of short completions from alice until stop; then every request in flight is dropped (the
    gateway cancels their jobs), so the worker is free at once."""
    body = {"model": MODEL, "messages": HI, "max_tokens": 4, "temperature": 0}
    headers = {"authorization": f"Bearer {KEYS['alice']}"}
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=120,
                                 limits=httpx.Limits(max_connections=n + 4)) as client:
        async def loop() -> None:
            while True:
                r = await client.post("/v1/chat/completions", json=body)
                counts[r.status_code] = counts.get(r.status_code, 0) + 1
                if r.status_code == 429:
                    counts["retry_after"] = r.headers.get("retry-after")
                    counts["message"] = r.json()["error"]["message"]
                    await asyncio.sleep(1.0)
        tasks = [asyncio.create_task(loop()) for _ in range(n)]
        while not stop.is_set():
            await asyncio.sleep(0.1)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def test_one_keys_interactive_load_cannot_starve_anothers_batch(gateway_stack, tmp_path):
    """Attack 8: alice keeps 24 completions in flight (the key's limit; 2 more loops get 429), twice the
    worker's capacity of 8 seats + 4 read ahead, so interactive jobs always wait. Before, bob's batch did not
    start until alice stopped; now it keeps its 2 reserved seats (TOKENBUS_BULK_MIN_FRACTION 0.25 of 8)."""
    stop, counts = threading.Event(), {}
    flood = threading.Thread(target=lambda: asyncio.run(_hold(gateway_stack.base_url, 26, stop, counts)))
    flood.start()
    try:
        time.sleep(1.5)
        client = gateway_stack.openai("bob")
        f = client.files.create(file=write_jsonl(tmp_path / "b.jsonl", [chat_line(f"b{i}", f"Item {i}", max_tokens=3)
                                                                         for i in range(2)]).open("rb"),
                                purpose="batch")
        t0 = time.monotonic()
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        done = gateway_stack.wait_batch(client, batch.id, timeout=300)  # a few s on a quiet machine
        took = time.monotonic() - t0
        assert flood.is_alive() and not stop.is_set(), "alice was still at it when the batch ended"
    finally:
        stop.set()
        flood.join(30)
    assert done.status == "completed" and done.request_counts.completed == 2
    assert counts.get(200, 0) > 0 and counts.get(429, 0) > 0, counts
    assert "max_requests_per_key = 24" in counts["message"] and int(counts["retry_after"]) > 0
    print(f"\nattack 8: bob's 2-line batch completed in {took:.1f} s while alice held 24 completions in flight "
          f"({counts.get(200, 0)} answered, {counts.get(429, 0)} refused 429)")


def test_a_keys_priority_comes_from_the_gateway_configuration(gateway_stack):
    raw = gateway_stack.openai("dave").chat.completions.with_raw_response.create(
        model=MODEL, messages=HI, max_tokens=2, temperature=0)
    with gateway_stack.producer() as producer:
        assert producer.get(raw.headers["x-tokenbus-job-id"]).priority == "default"
    with gateway_stack.http("dave") as http:  # a request cannot pick its own priority
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": HI, "priority": "interactive"})
        assert r.status_code == 400


def test_a_batch_past_the_keys_queued_token_quota_is_refused(gateway_stack, tmp_path):
    """30 lines asking 4,000 tokens each: 120,000 queued tokens, over the harness's 100,000 per key."""
    client = gateway_stack.openai("dave")
    lines = [chat_line(f"big-{i}", "Write a long story.", max_tokens=4000) for i in range(30)]
    f = client.files.create(file=write_jsonl(tmp_path / "big.jsonl", lines).open("rb"), purpose="batch")
    with gateway_stack.http("dave") as http:
        r = http.post("/v1/batches", json={"input_file_id": f.id, "endpoint": "/v1/chat/completions",
                                           "completion_window": "24h"})
        assert r.status_code == 429 and int(r.headers["retry-after"]) > 0
        assert r.json()["error"]["code"] == "quota_exceeded"
        assert "max_queued_tokens_per_key = 100000" in r.json()["error"]["message"]
        assert all(b["input_file_id"] != f.id for b in http.get("/v1/batches").json()["data"])
