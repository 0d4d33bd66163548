"""Issue #34's residuals, what a key makes Redis hold beside its batches and results: a file's metadata counted
until the file is deleted, a dashboard session until it ends or expires, an ended batch's record (its errors
included) until its retention ends, each against the key's byte limits (keep_file.lua, ui_login.lua,
release_bytes.lua); and the default byte limits sized to Redis's maxmemory (capacity.derive_limits). Against the
light stack's real processes (testbed/light_gateway.py); the retention's end in test_gw_batch_retention.py."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import httpx
import openai
import pytest

from gateway.batches.capacity import KEY_SHARE
from gateway.byte_limits import INDEX_ENTRY_BYTES
from gateway.settings import owner_id
from testbed.gateway_procs import KEYS, Proc, healthy
from testbed.light_gateway import chat_line, wait_until
from testbed.redis_server import free_port
from tests.support.dashboard import Dashboard

GW = "{tokenbus}:gw"


def _ledger(r, who: str) -> dict[str, int]:
    return {h: int(b) for h, b in r.hgetall(f"{GW}:kept-bytes:{owner_id(KEYS[who])}").items()}


def _holds(r, who: str) -> int:
    """All a key holds against its byte limit: its open batches' reservations and its ledger (an earlier test's
    batch may still be open on this shared stack)."""
    return int(r.hget(f"{GW}:queued-bytes", owner_id(KEYS[who])) or 0) + sum(_ledger(r, who).values())


def _limit(r, per_key: int | None) -> None:
    if per_key is None:
        r.hdel(f"{GW}:config", "max_queued_bytes_per_key")
    else:
        r.hset(f"{GW}:config", "max_queued_bytes_per_key", per_key)


def test_a_files_metadata_counts_against_its_key_until_the_file_is_deleted(light_stack, tmp_path):
    r, volume = light_stack.r(), Path(light_stack.env["TOKENBUS_GATEWAY_FILES_DIR"])
    light_stack.pause("tasks")  # an earlier test's batch finalised now would count its record meanwhile
    light_stack.forget_kept()
    # A file of invalid lines keeps its line errors in its metadata (bounded: 21 of them, each clipped).
    lines = [json.dumps({"custom_id": f"bad{i}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": "m", "messages": "x" * 2000}}) for i in range(30)]
    try:
        fid = light_stack.upload("alice", lines, tmp_path)
        held = int(r.hget(f"{GW}:file:{fid}", "held_bytes"))
        assert held == r.memory_usage(f"{GW}:file:{fid}", samples=0) + INDEX_ENTRY_BYTES, "Redis's own count"
        assert held > 2_000, f"the file's metadata holds {held} bytes"
        assert _ledger(r, "alice").get("held") == held, "counted against its key, until it is deleted"
        files_before, on_disk = r.zcard(f"{GW}:files:{owner_id(KEYS['alice'])}"), len(list(volume.rglob("file-*")))
        _limit(r, _holds(r, "alice") + 1_000)  # room for a small file's metadata (~600 bytes), not another such
        with pytest.raises(openai.RateLimitError) as err:
            light_stack.upload("alice", lines, tmp_path)
        assert err.value.code == "stored_bytes_per_key_exceeded" and "delete files" in err.value.body["message"]
        assert err.value.response.headers["retry-after"]
        assert r.zcard(f"{GW}:files:{owner_id(KEYS['alice'])}") == files_before, "nothing of it kept"
        assert len(list(volume.rglob("file-*"))) == on_disk, "nor on the volume"
        small = light_stack.upload("alice", [chat_line("ok", "Hi")], tmp_path)  # a small file still fits
        light_stack.upload("bob", lines, tmp_path)  # another key's counts against its own
        light_stack.openai("alice").files.delete(fid)
        assert _ledger(r, "alice")["held"] == int(r.hget(f"{GW}:file:{small}", "held_bytes")), "given back"
        again = light_stack.upload("alice", lines, tmp_path)  # fits again
        for f in (again, small):
            light_stack.openai("alice").files.delete(f)
        assert "held" not in _ledger(r, "alice"), "every file deleted: nothing held"
    finally:
        _limit(r, None)
        light_stack.resume("tasks")


def test_dashboard_sessions_count_until_they_end_and_a_login_past_the_limit_is_refused(light_stack):
    r = light_stack.r()
    carol = owner_id(KEYS["carol"])
    light_stack.pause("tasks")  # an earlier test's batch finalised now would count its record meanwhile
    light_stack.forget_kept()
    first = Dashboard(light_stack.base_url, KEYS["carol"]).logged_in()
    second = Dashboard(light_stack.base_url, KEYS["carol"]).logged_in()
    try:
        hours = {h: b for h, b in _ledger(r, "carol").items() if h != "held"}
        assert len(hours) == 1, hours
        (hour, counted), = hours.items()
        assert int(hour) >= time.time() + 8 * 3600 - 60, "counted until the session has expired"
        keys = {d: f"{GW}:ui:session:{hashlib.sha256(d.session.encode()).hexdigest()}" for d in (first, second)}
        each = {d: int(r.hget(k, "kept_bytes")) for d, k in keys.items()}
        assert all(b == r.memory_usage(keys[d], samples=0) + INDEX_ENTRY_BYTES for d, b in each.items())
        assert counted == sum(each.values()), (counted, each)
        # Logging out gives a session's bytes back at once.
        csrf = first.get("/ui/").text.split('"X-CSRF-Token": "')[1].split('"')[0]
        assert first.http.post("/ui/logout", data={"csrf": csrf}).status_code == 303
        assert _ledger(r, "carol") == {hour: each[second]}
        # Past the key's byte limit a login is refused, saying so, and nothing is kept.
        _limit(r, _holds(r, "carol") + 50)
        third = Dashboard(light_stack.base_url, KEYS["carol"])
        refused = third.login()
        assert refused.status_code == 429 and "max_queued_bytes_per_key" in refused.text, refused.text[:500]
        assert refused.headers["retry-after"] and third.session is None
        assert sum(1 for k in r.scan_iter(f"{GW}:ui:session:*") if r.hget(k, "owner") == carol) == 1
        assert _ledger(r, "carol") == {hour: each[second]}
        assert second.get("/ui/workers", headers={"hx-request": "true"}).status_code == 200, "the live one lives"
    finally:
        _limit(r, None)
        light_stack.resume("tasks")
    for d in (first, second):
        d.close()


def test_a_failed_batchs_record_and_errors_stay_counted_after_its_results_expire(light_stack, tmp_path):
    r = light_stack.r()
    light_stack.forget_kept()  # dave: no earlier test's batch of his can end (and count) meanwhile
    long_id = "x" * 50_000
    fid = light_stack.upload("dave", [chat_line(long_id, "Hi") for _ in range(25)], tmp_path)
    b = light_stack.create("dave", fid)
    light_stack.wait_status("dave", b.id, ("failed",))
    key = f"{GW}:batch:{b.id}"
    wait_until(lambda: r.hget(key, "bytes_released_at"), 10, "the batch's reservation to be given back")
    held, hour = int(r.hget(key, "held_bytes")), r.hget(key, "held_until")
    # its entries in the key's list and in the list of ended batches by when they go; give or take a small field
    # the validating sweep may write or drop around the end (submit_lost_at: 128 bytes, seen in a full run)
    measured = r.memory_usage(key, samples=0) + 2 * INDEX_ENTRY_BYTES
    assert abs(held - measured) < INDEX_ENTRY_BYTES, ("Redis's own count of the record", held, measured)
    assert held > 5_000, f"its 21 bounded errors: {held} bytes"
    retention = 30 * 24 * 3600  # the default batch_retention_s
    assert time.time() + retention - 60 <= int(hour) <= time.time() + retention + 3600, "counted until it goes"
    assert time.time() + retention - 60 <= r.ttl(key) + time.time() <= int(hour) + 1, "it expires by then"
    file_held = int(r.hget(f"{GW}:file:{fid}", "held_bytes"))
    assert _ledger(r, "dave") == {"held": file_held, hour: held}, "the file for good, the record until it goes"
    # As if result_ttl (and more) had passed: the ledger's earlier hours trimmed, the record's is still counted.
    ledger = f"{GW}:kept-bytes:{owner_id(KEYS['dave'])}"
    for h in [h for h in _ledger(r, "dave") if h not in ("held", hour)]:
        r.hdel(ledger, h)
    light_stack.openai("dave").files.delete(fid)
    assert _ledger(r, "dave") == {hour: held} and 0 < r.ttl(ledger) <= int(hour) - time.time() + 1, \
        "a ledger without held records expires with its last hour: the record's"
    try:
        assert _holds(r, "dave") >= held, "the record alone counts after its results' hours passed"
        _limit(r, _holds(r, "dave") + 500)  # no small file's metadata (~600 bytes) fits beside it
        with pytest.raises(openai.RateLimitError) as err:
            light_stack.upload("dave", [chat_line("ok", "Hi")], tmp_path)
        assert err.value.code == "stored_bytes_per_key_exceeded"
        with light_stack.http("dave") as c:
            call = c.post("/v1/chat/completions", json={"model": "m", "max_tokens": 4,
                                                        "messages": [{"role": "user", "content": "Hi"}]})
        assert call.status_code == 429 and call.json()["error"]["code"] == "stored_bytes_per_key_exceeded"
    finally:
        _limit(r, None)
    assert r.exists(key) and light_stack.openai("dave").batches.retrieve(b.id).status == "failed"


def _start_gateway(stack, tmp_path, name: str, **env: str) -> tuple[Proc, str]:
    port = free_port()
    settings = {k: v for k, v in stack.env.items() if not k.startswith("TOKENBUS_GATEWAY_MAX_QUEUED_BYTES")}
    proc = Proc(name, ["-m", "gateway", "serve"], settings | {"TOKENBUS_GATEWAY_PORT": str(port)} | env, tmp_path)
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: healthy(url), 60, f"{name}'s /healthz", [proc], every=0.1)
    return proc, url


def _derived(proc: Proc) -> dict:
    for line in proc.tail(20_000).splitlines():
        if "gateway_byte_limits_from_maxmemory" in line:
            return json.loads(line)
    return {}


def test_default_byte_limits_are_sized_to_redis_maxmemory_and_set_ones_win(light_stack, tmp_path):
    r = light_stack.r()
    light_stack.forget_kept()
    reserve = 64 << 20  # the default redis_reserve_bytes
    maxmemory = reserve + (40 << 20)  # 40 MiB of room: everyone's 40 MiB, one key's 10 MiB
    # ~62 MB at most: 4096 tokens x n 16 x (24 + 44 x 21 logprob entries): under the fixed 512 MiB and 4 GiB,
    # over 40 MiB
    heavy = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4096, "n": 16,
             "logprobs": True, "top_logprobs": 20}
    procs = []
    try:
        r.config_set("maxmemory", maxmemory)
        derived, url = _start_gateway(light_stack, tmp_path, "gateway-derived")
        procs.append(derived)
        said = _derived(derived)
        assert said.get("max_queued_bytes") == maxmemory - reserve, derived.tail()
        assert said.get("max_queued_bytes_per_key") == (maxmemory - reserve) // KEY_SHARE
        with httpx.Client(base_url=url, headers={"authorization": f"Bearer {KEYS['alice']}"}, timeout=10) as c:
            refused = c.post("/v1/chat/completions", json=heavy)
        assert refused.status_code == 429, refused.text[:300]
        assert refused.json()["error"]["code"] == "stored_bytes_per_key_exceeded", refused.text[:300]
        assert f"max_queued_bytes_per_key {(maxmemory - reserve) // KEY_SHARE}" in refused.text
        # A per-key limit that is set wins; everyone's, left unset, is still Redis's room.
        mine, url = _start_gateway(light_stack, tmp_path, "gateway-set-per-key",
                                   TOKENBUS_GATEWAY_MAX_QUEUED_BYTES_PER_KEY=str(100 << 20))
        procs.append(mine)
        said = _derived(mine)
        assert said.get("max_queued_bytes") == maxmemory - reserve and "max_queued_bytes_per_key" not in said
        with httpx.Client(base_url=url, headers={"authorization": f"Bearer {KEYS['alice']}"}, timeout=10) as c:
            refused = c.post("/v1/chat/completions", json=heavy)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "stored_bytes_exceeded", \
            refused.text[:300]
        # Both set: nothing derived, nothing logged.
        both, _ = _start_gateway(light_stack, tmp_path, "gateway-set-both",
                                 TOKENBUS_GATEWAY_MAX_QUEUED_BYTES_PER_KEY=str(100 << 20),
                                 TOKENBUS_GATEWAY_MAX_QUEUED_BYTES=str(30 << 20))
        procs.append(both)
        assert _derived(both) == {}
    finally:
        r.config_set("maxmemory", 0)
        for p in procs:
            p.stop()
