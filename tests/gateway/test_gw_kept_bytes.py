"""Issue #34 item 4, what results keep in Redis for result_ttl: an interactive completion's result (logprobs
included) counted against its key before it is queued, and a finished batch's results still counted after its
reservation is given back, each until the records expire (gateway/kept_bytes.py). Against the light stack's real
processes; its jobs are ended by a stand-in worker writing results the size a model's would be."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import openai
import pytest

from gateway.settings import owner_id
from protocol.keys import Keys
from testbed.gateway_procs import KEYS
from testbed.light_gateway import LightStack, chat_line

GW = "{tokenbus}:gw"
HEAVY = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32, "n": 8,
         "logprobs": True, "top_logprobs": 20}
PLAIN = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32}


def full_result(request: dict) -> dict:
    """A result as a worker writes it for `request`: max_tokens tokens for each of n, and with logprobs
    1 + top_logprobs candidates a token, their ids drawn from a 3,000-token vocabulary (texts of 3-6 bytes)."""
    n, tokens, top = request.get("n", 1), request.get("max_tokens", 16), request.get("logprobs")
    choices, named = [], {}
    for c in range(n):
        ids = [(c * 977 + t * 131) % 3000 for t in range(tokens)]
        lps = None if top is None else [{(i + k * 37) % 3000: -0.25 * k - 0.01 for k in range(top + 1)} for i in ids]
        for row in lps or []:
            named.update({i: {"text": f"t{i}", "bytes": list(f"t{i}".encode())} for i in row})
        choices.append({"index": c, "text": "".join(f"t{i}" for i in ids), "token_ids": ids,
                        "finish_reason": "length", "logprobs": lps})
    first = choices[0]
    return {"text": first["text"], "token_ids": first["token_ids"], "finish_reason": "length",
            "logprobs": first["logprobs"], "logprob_tokens": named or None, "model": "smollm2-135m",
            "usage": {"prompt_tokens": 1, "completion_tokens": n * tokens, "total_tokens": n * tokens + 1},
            "choices": choices}


@contextmanager
def stand_in_worker(stack: LightStack) -> Iterator[list[str]]:
    """Ends every queued job with full_result of its request (the worker's own Lua, LightStack.end_job)."""
    r, keys, stop, ended = stack.r(), Keys("tokenbus"), threading.Event(), []

    def run() -> None:
        while not stop.is_set():
            for key in list(r.scan_iter(keys.job("*"), count=1000)):
                job_id = key.rsplit(":", 1)[-1]
                if ":" in key.removeprefix(keys.job("")) or r.hget(key, "status") != "queued":
                    continue
                entry, queue = r.hmget(key, "entry_id", "queue")
                found = r.xrange(queue, entry, entry) if entry and queue else []
                if found:
                    stack.end_job(job_id, result=full_result(json.loads(found[0][1]["request"])))
                    ended.append(job_id)
            time.sleep(0.02)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        yield ended
    finally:
        stop.set()
        t.join(5)


def _chat(stack: LightStack, who: str, body: dict) -> httpx.Response:
    with stack.http(who) as c:
        return c.post("/v1/chat/completions", json=body, timeout=30)


def _usage(r, *keys: str) -> int:
    """What Redis holds for these keys, every field counted (MEMORY USAGE samples 5 by default)."""
    return sum(r.memory_usage(k, samples=0) for k in keys)


def _ledger(r, who: str) -> dict[int, int]:
    """The key's ledger by hour (without its `held` field: records kept until deleted, test_gw_held_bytes.py;
    an ended batch's record is in the hour its retention ends in)."""
    return {int(h): int(b) for h, b in r.hgetall(f"{GW}:kept-bytes:{owner_id(KEYS[who])}").items() if h != "held"}


def test_completions_with_logprobs_count_against_their_key_until_their_results_expire(light_stack):
    r = light_stack.r()
    light_stack.forget_kept()
    try:
        with stand_in_worker(light_stack):
            first = _chat(light_stack, "alice", HEAVY)
            assert first.status_code == 200, first.text[:300]
            job_id = first.headers["x-tokenbus-job-id"]
            real = int(r.hget(f"{GW}:job:{job_id}", "kept_bytes"))
            stored = _usage(r, Keys("tokenbus").job(job_id), f"{GW}:job:{job_id}")
            assert stored > 100_000, f"the result with logprobs holds {stored} bytes in Redis"
            assert 0.95 * stored <= real <= 1.05 * stored, (stored, real)  # counted as held, once it ended
            hour = max(_ledger(r, "alice"))
            assert hour >= time.time() + r.ttl(f"{GW}:job:{job_id}"), "counted until its records expire"
            # Room for two more such results (~230 KB each; a call's most is ~245 KB) and a call without logprobs
            # (~3 KB), not for a fourth with them.
            r.hset(f"{GW}:config", "max_queued_bytes_per_key", 3 * real + 30_000)
            for _ in range(2):
                assert _chat(light_stack, "alice", HEAVY).status_code == 200
            refused = _chat(light_stack, "alice", HEAVY)
            assert refused.status_code == 429, refused.text[:300]
            error = refused.json()["error"]
            assert error["code"] == "stored_bytes_per_key_exceeded" and "top_logprobs" in error["message"], error
            assert refused.headers["retry-after"]
            assert _chat(light_stack, "bob", HEAVY).status_code == 200, "another key's call is served"
            assert _chat(light_stack, "alice", PLAIN).status_code == 200, "the same call without logprobs fits"
            streamed = _chat(light_stack, "alice", PLAIN | {"stream": True})
            assert streamed.status_code == 200 and "[DONE]" in streamed.text
            ownership = r.hgetall(f"{GW}:job:{streamed.headers['x-tokenbus-job-id']}")
            assert ownership["settled"] == "1" and int(ownership["kept_bytes"]) < 10_000, ownership
            # Once the hours its results were kept in have passed (as if 8 days went by), they count no more.
            for h, b in _ledger(r, "alice").items():
                r.hdel(f"{GW}:kept-bytes:{owner_id(KEYS['alice'])}", h)
                r.hincrby(f"{GW}:kept-bytes:{owner_id(KEYS['alice'])}", int(time.time()) - 1, b)
            assert _chat(light_stack, "alice", HEAVY).status_code == 200
            assert min(_ledger(r, "alice")) > time.time(), "the ended hour was trimmed"
    finally:
        r.hdel(f"{GW}:config", "max_queued_bytes_per_key")


def test_a_finished_batchs_results_keep_counting_until_they_expire(light_stack, tmp_path):
    r = light_stack.r()
    light_stack.forget_kept()
    lines = [chat_line(f"h{i}", "Hi", max_tokens=32, n=8, logprobs=True, top_logprobs=20) for i in range(3)]
    with stand_in_worker(light_stack) as ended:
        b = light_stack.batch("alice", lines, tmp_path)
        light_stack.wait_status("alice", b.id, ("completed",))
    job_ids = r.lrange(Keys("tokenbus").batch_jobs(b.id), 0, -1)
    assert len(job_ids) == 3 and set(job_ids) <= set(ended)
    record = r.hgetall(f"{GW}:batch:{b.id}")
    assert record["bytes_released_at"], "its reservation was given back at finalisation"
    kept = int(record["kept_bytes"])
    stored = _usage(r, *(Keys("tokenbus").job(j) for j in job_ids))
    assert stored > 300_000 and kept == stored, (stored, kept)
    assert int(record["kept_until"]) >= time.time() + max(r.ttl(Keys("tokenbus").job(j)) for j in job_ids)
    # its results until they expire, and its own record until it goes (test_gw_batch_retention.py)
    assert sum(_ledger(r, "alice").values()) == kept + int(record["held_bytes"])
    try:
        r.hset(f"{GW}:config", "max_queued_bytes_per_key", kept + 100_000)
        refused = _chat(light_stack, "alice", HEAVY)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "stored_bytes_per_key_exceeded"
        with pytest.raises(openai.RateLimitError) as err:
            light_stack.batch("alice", lines[:1], tmp_path)
        assert err.value.code == "queued_bytes_per_key_exceeded" and "results kept" in err.value.body["message"]
        with stand_in_worker(light_stack):
            assert _chat(light_stack, "bob", HEAVY).status_code == 200, "another key's call is served"
        # Everyone's results kept count against the global limit too.
        r.hdel(f"{GW}:config", "max_queued_bytes_per_key")
        everyone = sum(int(b) for b in r.hgetall(f"{GW}:kept-bytes:*").values())
        assert everyone >= kept + 200_000, "alice's batch and bob's call"
        r.hset(f"{GW}:config", "max_queued_bytes", everyone + int(r.hget(f"{GW}:queued-bytes", "*") or 0) + 100_000)
        refused = _chat(light_stack, "carol", HEAVY)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "stored_bytes_exceeded"
    finally:
        r.hdel(f"{GW}:config", "max_queued_bytes_per_key", "max_queued_bytes")
