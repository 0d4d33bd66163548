"""Issue #22 attack 1, the stream flood: 120 `stream: true` completions from one key emptied the gateway's
100-connection Redis pool; every tenant and /healthz got 503 for minutes, and the abandoned jobs stayed
queued because their cancel failed. Now streams hold no pooled connection, a key's streams are capped (429 +
Retry-After), /healthz has its own connection, and a disconnected stream's job is cancelled."""

from __future__ import annotations

import asyncio
import time

import httpx

from tests.support.gateway_harness import KEYS, MODEL, wait_until

FLOOD = 120
CAP = 16  # TOKENBUS_GATEWAY_MAX_STREAMS_PER_KEY in the harness


async def _flood(base_url: str, opened: list, refused: list, stop: asyncio.Event) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count to one thousand."}],
            "max_tokens": 400, "temperature": 0, "stream": True}
    headers = {"authorization": f"Bearer {KEYS['alice']}"}
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=60,
                                 limits=httpx.Limits(max_connections=FLOOD + 10)) as client:
        async def one() -> None:
            async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    refused.append((resp.status_code, resp.headers.get("retry-after"), resp.json()))
                    return
                opened.append(resp.headers["x-tokenbus-job-id"])
                async for _line in resp.aiter_lines():  # hold the stream open until told to go away
                    if stop.is_set():
                        return
        tasks = [asyncio.create_task(one()) for _ in range(FLOOD)]
        await stop.wait()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def test_stream_flood_is_capped_and_starves_nobody(gateway_stack):
    r = gateway_stack.redis.client()
    opened, refused = [], []
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    flood = loop.create_task(_flood(gateway_stack.base_url, opened, refused, stop))
    try:
        deadline = time.monotonic() + 60
        while len(opened) + len(refused) < FLOOD and time.monotonic() < deadline:
            loop.run_until_complete(asyncio.sleep(0.1))
        assert len(opened) == CAP and len(refused) == FLOOD - CAP, (len(opened), len(refused))
        status, retry_after, body = refused[0]
        assert status == 429 and retry_after and int(retry_after) > 0
        assert "max_streams_per_key = 16" in body["error"]["message"]
        assert body["error"]["code"] == "rate_limit_exceeded"

        # During the flood: the open streams do not each block a Redis connection (one thread reads them
        # all), and other calls are answered.
        blocked = []
        for _ in range(10):
            loop.run_until_complete(asyncio.sleep(0.1))
            blocked.append(int(r.info("clients")["blocked_clients"]))
        with httpx.Client(base_url=gateway_stack.base_url, timeout=10) as plain:
            for _ in range(3):
                t0 = time.monotonic()
                assert plain.get("/healthz").status_code == 200
                assert time.monotonic() - t0 < 2.0
        with gateway_stack.http("bob") as bob:
            assert bob.get("/v1/files").status_code == 200
        # the hub, the job waiter, the batch watcher, the worker's intake: not one per stream
        assert max(blocked) <= 6, f"{CAP} open streams: {blocked} clients blocked in Redis"
    finally:
        stop.set()
        loop.run_until_complete(flood)
        loop.close()

    # Every abandoned stream's job is cancelled (none stays queued), and the key may stream again.
    producer = gateway_stack.producer()

    def all_ended():
        return all(j is not None and j.status.value in ("cancelled", "finished", "failed")
                   for j in producer.get_many(opened))
    wait_until(all_ended, 60, "the abandoned streams' jobs to be cancelled", list(gateway_stack.procs.values()),
               every=0.2)
    assert sum(j.status.value == "cancelled" for j in producer.get_many(opened)) >= CAP - 8
    client = gateway_stack.openai("bob")
    t0 = time.monotonic()
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=4, temperature=0, stream=True))
    assert chunks and time.monotonic() - t0 < 30
    producer.close()
