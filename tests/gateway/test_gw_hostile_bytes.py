"""Issue #34, what one key can make Redis hold: error texts bounded in a batch record and counted in its
reservation (1), results with logprobs counted in a batch's reservation (4), text that is not storable UTF-8
refused at the edge naming the field or the line (11, 12), and a full or too small Redis said as such (16).
Against the light stack's real processes (testbed/light_gateway.py)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from testbed.gateway_procs import Proc
from testbed.light_gateway import chat_line, wait_until, write_jsonl
from testbed.redis_server import free_port

GW_CONFIG = "{tokenbus}:gw:config"


def test_a_repeated_long_custom_id_is_not_copied_into_the_batch_record(light_stack, tmp_path):
    r = light_stack.r()
    long_id = "x" * 400_000
    fid = light_stack.upload("alice", [chat_line(long_id, "Hi") for _ in range(9)], tmp_path)  # 3.6 MB file
    b = light_stack.create("alice", fid)
    done = light_stack.wait_status("alice", b.id, ("failed",))
    assert [e.code for e in done.errors.data] == ["duplicate_custom_id"] * 8
    assert "(400000 characters)" in done.errors.data[0].message and len(done.errors.data[0].message) < 300
    record = r.memory_usage(f"{{tokenbus}}:gw:batch:{b.id}")
    assert record < 32_000, f"the batch record holds {record} bytes (was ~3.2 MB: the id in every error)"
    assert r.memory_usage(f"{{tokenbus}}:gw:file:{fid}") < 32_000, "the file's record too"
    reserved = int(r.hget(f"{{tokenbus}}:gw:batch:{b.id}", "reserved_bytes"))
    assert reserved > 1_000, "the record's own bytes were reserved while it was open"
    assert r.hget(f"{{tokenbus}}:gw:batch:{b.id}", "bytes_released_at"), "and given back when it ended"


def test_results_with_logprobs_are_counted_in_a_batch_reservation(light_stack, tmp_path):
    r = light_stack.r()
    plain = [chat_line(f"p{i}", "Hi", max_tokens=32, n=4) for i in range(4)]
    heavy = [chat_line(f"p{i}", "Hi", max_tokens=32, n=4, logprobs=True, top_logprobs=20) for i in range(4)]
    a = light_stack.batch("alice", plain, tmp_path)
    plain_bytes = int(r.hget(f"{{tokenbus}}:gw:batch:{a.id}", "reserved_bytes"))
    light_stack.openai("alice").batches.cancel(a.id)
    light_stack.wait_status("alice", a.id, ("cancelled",))
    # 4 lines x 32 tokens x n 4 x (1 + 20) logprob entries: ~850 bytes a token, kept until the batch ends
    light_stack.forget_kept()  # what earlier tests' results keep would count against the limit too
    try:
        r.hset(GW_CONFIG, "max_queued_bytes_per_key", plain_bytes + 100_000)
        with pytest.raises(openai.RateLimitError) as err:
            light_stack.batch("alice", heavy, tmp_path)
        assert err.value.code == "queued_bytes_per_key_exceeded"
        b = light_stack.batch("alice", plain, tmp_path)  # the same file without logprobs still fits
    finally:
        r.hdel(GW_CONFIG, "max_queued_bytes_per_key")
    heavy_b = light_stack.batch("alice", heavy, tmp_path)
    heavy_bytes = int(r.hget(f"{{tokenbus}}:gw:batch:{heavy_b.id}", "reserved_bytes"))
    assert heavy_bytes - plain_bytes >= 4 * 32 * 4 * 21 * 40, (plain_bytes, heavy_bytes)
    for batch in (b, heavy_b):
        light_stack.openai("alice").batches.cancel(batch.id)


def _raw_post(stack, path: str, body: bytes) -> httpx.Response:
    with stack.http("alice") as c:
        return c.post(path, content=body, headers={"content-type": "application/json"})


def test_a_lone_surrogate_in_batch_metadata_is_refused_naming_the_field(light_stack, tmp_path):
    fid = light_stack.upload("alice", [chat_line("a", "Hi")], tmp_path)
    with light_stack.http("alice") as c:
        before = c.get("/v1/batches", params={"limit": 100}).json()["data"]
    head = b'{"input_file_id": "' + fid.encode() + b'", "endpoint": "/v1/chat/completions", '
    for meta, param in ((b'{"tag": "\\ud800"}', "metadata.tag"), (b'{"\\udfff": "v"}', "metadata (an object key)")):
        resp = _raw_post(light_stack, "/v1/batches", head + b'"completion_window": "24h", "metadata": ' + meta + b"}")
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == param and "surrogate" in resp.json()["error"]["message"]
    chat = _raw_post(light_stack, "/v1/chat/completions",
                     b'{"model": "m", "messages": [{"role": "user", "content": "a\\ud83d b"}]}')
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages.0.content", chat.text
    with light_stack.http("alice") as c:
        after = c.get("/v1/batches", params={"limit": 100})
    ids = [b["id"] for b in before]  # ids, not whole objects: an earlier test's batch may end meanwhile
    assert after.status_code == 200 and [b["id"] for b in after.json()["data"]] == ids, \
        "no batch was made, the list still works"
    pair = _raw_post(light_stack, "/v1/batches", head + b'"completion_window": "24h", "metadata": '
                     b'{"tag": "\\ud83d\\ude00"}}')  # a surrogate pair is one character: fine
    assert pair.status_code == 200 and pair.json()["metadata"] == {"tag": "\U0001f600"}, pair.text
    light_stack.openai("alice").batches.cancel(pair.json()["id"])


def test_a_lone_surrogate_custom_id_refuses_the_upload_naming_the_line(light_stack, tmp_path):
    bad = json.dumps({"custom_id": "\ud800", "method": "POST", "url": "/v1/chat/completions",
                      "body": {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}})
    assert "\\ud800" in bad
    src = write_jsonl(tmp_path / "surrogate.jsonl", [chat_line("ok", "Hi"), bad])
    with pytest.raises(openai.BadRequestError) as err:
        light_stack.openai("alice").files.create(file=src.open("rb"), purpose="batch")
    message = err.value.body["message"]
    assert "line 2" in message and "custom_id" in message and "surrogate" in message, message


def test_a_full_redis_is_reported_as_full_not_unreachable(light_stack):
    r = light_stack.r()
    try:
        r.config_set("maxmemory", int(r.info("memory")["used_memory"]) + 256 * 1024)
        filler = 0
        for size in (65536, 1024, 64):  # fill it up to maxmemory with one key's junk, to the last few bytes:
            while True:  # a failed 64 KB write frees its buffer, leaving room for a small one
                try:
                    r.set(f"junk:{filler}", "x" * size)
                    filler += 1
                except Exception:
                    break
        # and keep it full: idle clients' buffers shrink after a busy test before this one, freeing ~100s of KB
        r.config_set("maxmemory", int(r.info("memory")["used_memory"]) - 1024 * 1024)
        with light_stack.http("alice") as c:
            resp = c.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "Hi"}]})
        assert resp.status_code == 503, resp.text
        error = resp.json()["error"]
        assert error["code"] == "redis_full" and "maxmemory" in error["message"], error
        assert "cannot reach" not in error["message"]
    finally:
        r.config_set("maxmemory", 0)
        for i in range(filler + 1):
            r.delete(f"junk:{i}")


def test_a_maxmemory_below_the_reserve_is_said_at_start_and_at_create(light_stack, tmp_path):
    r = light_stack.r()
    fid = light_stack.upload("alice", [chat_line("a", "Hi")], tmp_path)
    port = free_port()
    env = dict(light_stack.env, TOKENBUS_GATEWAY_PORT=str(port), TOKENBUS_GATEWAY_REDIS_RESERVE_BYTES=str(64 << 20))
    try:
        r.config_set("maxmemory", 48 << 20)  # below the 64 MiB reserve: no batch could ever be admitted
        proc = Proc("gateway-small-redis", ["-m", "gateway", "serve"], env, tmp_path)
        try:
            wait_until(lambda: proc.proc.poll() is not None, 60, "the gateway to refuse to start")
        finally:
            proc.stop()
        assert proc.proc.returncode == 2
        assert "maxmemory" in proc.tail() and "redis_reserve_bytes" in proc.tail(), proc.tail()
        # Lowered at run time on a running gateway: the batch is refused saying why, not "retry".
        with pytest.raises(openai.InternalServerError) as err:
            light_stack.create("alice", fid)
        assert err.value.status_code == 503 and err.value.code == "redis_reserve_too_large"
        assert "redis_reserve_bytes" in err.value.body["message"] and "retry" not in err.value.body["message"]
    finally:
        r.config_set("maxmemory", 0)
