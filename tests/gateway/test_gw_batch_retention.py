"""An ended batch is kept batch_retention_s, then goes with its entries and its output files, and what its key
was counted for it goes with it (issue #34 follow-up: records counted for good let a key running batches every
day reach its byte limit for good). A light stack of its own (testbed/light_gateway.py) whose gateway, tasks and
webhooks processes keep ended batches a few seconds."""

from __future__ import annotations

import time

import openai
import pytest

from gateway.byte_limits import INDEX_ENTRY_BYTES
from gateway.settings import owner_id
from protocol.scripts import lua, script
from testbed.light_gateway import KEYS, chat_line, start_light_stack, stop_light_stack, wait_until

GW = "{tokenbus}:gw"
RETENTION_S = 8  # long enough to look at both batches before they go, on a loaded machine


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = start_light_stack(tmp_path_factory.mktemp("retention"),
                          {"TOKENBUS_GATEWAY_BATCH_RETENTION_S": str(RETENTION_S)})
    yield s
    stop_light_stack(s)


def _holds(r, owner: str) -> int:
    """All the key holds against its byte limit: open reservations and its ledger, every field."""
    ledger = r.hgetall(f"{GW}:kept-bytes:{owner}")
    return int(r.hget(f"{GW}:queued-bytes", owner) or 0) + sum(int(b) for b in ledger.values())


def test_an_ended_batch_goes_after_its_retention_and_what_its_key_was_counted_with_it(stack, tmp_path):
    r, client, alice = stack.r(), stack.openai("alice"), owner_id(KEYS["alice"])
    bad = stack.upload("alice", [chat_line("same", "Hi") for _ in range(3)], tmp_path)  # 2 duplicate ids
    good = stack.upload("alice", [chat_line(f"c{i}", "Hi") for i in range(2)], tmp_path)
    before = _holds(r, alice)  # the input files' metadata, held until deleted
    failed = stack.create("alice", bad)
    done = stack.create("alice", good)
    stack.wait_status("alice", done.id, ("in_progress",))
    for i in range(2):
        stack.end_job(f"{done.id}-{i}", text=f"answer {i}")
    done = stack.wait_status("alice", done.id, ("completed",))
    failed = stack.wait_status("alice", failed.id, ("failed",))
    keys = {b.id: f"{GW}:batch:{b.id}" for b in (failed, done)}
    wait_until(lambda: all(r.hget(k, "bytes_released_at") for k in keys.values()), 10, "both to be released")
    records = {bid: r.hgetall(k) for bid, k in keys.items()}
    out = f"{GW}:file:{done.output_file_id}"
    # While kept: each record counted by Redis's own count (with its two entries) in the hour it goes by, and
    # listed by when it goes; the output file goes with it (no output_expires_after asked).
    held = {bid: int(rec["held_bytes"]) for bid, rec in records.items()}
    for bid, rec in records.items():
        # Redis's own count, give or take a small field the validating sweep may write or drop around the end
        # (submit_lost_at: 128 bytes were seen), which is less than an entry
        measured = r.memory_usage(keys[bid], samples=0) + 2 * INDEX_ENTRY_BYTES
        assert abs(held[bid] - measured) < INDEX_ENTRY_BYTES, (held[bid], measured, rec)
        due = r.zscore(f"{GW}:ended-batches", f"{alice}:{bid}")
        assert due == pytest.approx(float(rec["bytes_released_at"]) + RETENTION_S, abs=0.01)
        assert 0 < r.ttl(keys[bid]) <= int(rec["held_until"]) - time.time() + 1, "it expires by then anyway"
    assert float(r.hget(out, "expires_at")) == pytest.approx(float(records[done.id]["ended_at"]) + RETENTION_S,
                                                             abs=2)
    kept = int(records[done.id]["kept_bytes"])  # its results, kept for result_ttl
    out_held = int(r.hget(out, "held_bytes"))
    assert _holds(r, alice) == before + kept + sum(held.values()) + out_held
    assert client.batches.retrieve(failed.id).status == "failed" and client.files.retrieve(done.output_file_id)
    # An entry whose record went already (as Redis expires it, should no watcher run): skipped, the page filled.
    r.zadd(f"{GW}:batches:{alice}", {"batch_gone": time.time() + 1_000})
    page = client.batches.list(limit=1)
    assert [b.id for b in page.data] == [done.id] and page.has_more
    assert [b.id for b in client.batches.list(limit=2, after=done.id).data] == [failed.id]
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_gone")

    wait_until(lambda: not any(r.exists(k) for k in (*keys.values(), out)), RETENTION_S + 30,
               "the records past their retention to be deleted", stack.all(), every=0.1)
    assert _holds(r, alice) == before + kept, "the records' and the output file's counts went with them"
    print(f"\nretention {RETENTION_S} s: records {held} bytes counted, output file {out_held}; after "
          f"{time.time() - float(records[done.id]['bytes_released_at']):.1f} s the key holds {before} + {kept} "
          "(its results) again")
    assert r.zcard(f"{GW}:ended-batches") == 0
    assert r.zrange(f"{GW}:batches:{alice}", 0, -1) == ["batch_gone"], "their entries went too"
    for bid in keys:
        with pytest.raises(openai.NotFoundError):
            client.batches.retrieve(bid)
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(done.output_file_id)
    page = client.batches.list(limit=5)
    assert page.data == [] and not page.has_more, "the list skips what has gone"
    # Forgetting a batch again gives nothing back a second time.
    again = script(lua("forget_batch"))(
        keys=[keys[failed.id], f"{GW}:batches:{alice}", f"{GW}:ended-batches", f"{GW}:kept-bytes:{alice}",
              f"{GW}:kept-bytes:*"], args=[failed.id, f"{alice}:{failed.id}"], client=r)
    assert again == 0 and _holds(r, alice) == before + kept
    assert not any(r.exists(k) for k in keys.values())


def test_a_retention_of_0_keeps_an_ended_batchs_record_for_good_counted_as_held(stack):
    """RELEASE_BYTES as capacity.release runs it with batch_retention_s 0: the old counting, for good."""
    r, owner, bid = stack.r(), "key_forever", "batch_forever"
    key, ledger = f"{GW}:batch:{bid}", f"{GW}:kept-bytes:{owner}"
    r.hset(key, mapping={"id": bid, "owner": owner, "reserved_bytes": 1_000})
    r.hincrby(f"{GW}:queued-bytes", owner, 1_000)
    r.hincrby(f"{GW}:queued-bytes", "*", 1_000)
    release = script(lua("release_bytes"))
    args = [owner, time.time(), 0, 0, INDEX_ENTRY_BYTES, bid, 0, 0]
    keys = [key, f"{GW}:queued-bytes", ledger, f"{GW}:kept-bytes:*", f"{GW}:ended-batches"]
    try:
        assert release(keys=keys, args=args, client=r) == 1_000
        assert release(keys=keys, args=args, client=r) == 0, "once"
        held = int(r.hget(key, "held_bytes"))
        assert held == r.memory_usage(key, samples=0) + INDEX_ENTRY_BYTES and r.hget(key, "held_until") == "held"
        assert r.hgetall(ledger) == {"held": str(held)} and r.ttl(ledger) == -1 and r.ttl(key) == -1
        assert r.zscore(f"{GW}:ended-batches", f"{owner}:{bid}") is None, "nothing will delete it"
        assert int(r.hget(f"{GW}:queued-bytes", owner)) == 0
    finally:
        r.hincrby(f"{GW}:kept-bytes:*", "held", -int(r.hget(key, "held_bytes") or 0))
        r.delete(key, ledger)
