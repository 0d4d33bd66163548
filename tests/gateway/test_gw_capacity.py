"""Issue #22, Redis capacity: per-key and global byte limits checked before anything is queued; Redis running
out of memory during an ingest fails that batch alone and frees what it wrote; the tasks process survives
Redis refusing its own writes, and exits 1 (never 0) when that lasts."""

from __future__ import annotations

import time

import openai
import pytest

from gateway.batches.capacity import estimate
from gateway.byte_limits import INDEX_ENTRY_BYTES
from testbed.light_gateway import chat_line, wait_until


def _set(r, **limits):
    for k, v in limits.items():
        if v is None:
            r.hdel("{tokenbus}:gw:config", k)
        else:
            r.hset("{tokenbus}:gw:config", k, v)


def _held(r, owner: str = "*") -> int:
    """All `owner` ("*": everyone) holds against the byte limits: open batches' reservations and the ledger
    (files, ended batches' records)."""
    return int(r.hget("{tokenbus}:gw:queued-bytes", owner) or 0) + \
        sum(int(b) for b in r.hgetall(f"{{tokenbus}}:gw:kept-bytes:{owner}").values())


def _settled(r) -> None:
    """Wait for open batches being cancelled to end: each gives back its reservation when it does, which would
    make room under a limit set from what is held now (earlier tests' batches on this shared stack)."""
    def ending() -> list[str]:
        out = []
        for key in r.scan_iter("{tokenbus}:gw:batch:*", count=1000):
            cancel, final, released = r.hmget(key, "cancel_requested_at", "final_status", "bytes_released_at")
            if (cancel or final) and not released:
                out.append(key)
        return out

    wait_until(lambda: not ending(), 30, "earlier tests' cancelled batches to end", every=0.1)


def test_byte_limits_refuse_before_anything_is_queued(light_stack, tmp_path):
    r = light_stack.r()
    probe = light_stack.batch("alice", [chat_line(f"p{i}", "Hello there") for i in range(2)], tmp_path)
    two = int(r.hget(f"{{tokenbus}}:gw:batch:{probe.id}", "reserved_bytes"))  # a 2-line batch's reservation
    assert two > 2 * estimate(1, len(chat_line("p0", "Hello there")) + 1), "its jobs, their results and its record"
    light_stack.wait_status("alice", probe.id, ("in_progress",))  # its jobs written: they stay, cancelled
    light_stack.openai("alice").batches.cancel(probe.id)
    light_stack.wait_status("alice", probe.id, ("cancelled",))
    wait_until(lambda: r.hget(f"{{tokenbus}}:gw:batch:{probe.id}", "bytes_released_at"), 10,
               "the probe's bytes to move to the ledger (right after its status)")
    jobs_before = len(r.keys("{tokenbus}:job:*"))
    light_stack.forget_kept()  # what earlier tests' results keep would count against these limits too
    # The files first: their metadata counts too (test_gw_held_bytes.py), so the limits are set above them.
    files = {name: light_stack.upload(who, [chat_line(f"{name}{i}", "Hello there") for i in range(n)], tmp_path)
             for name, who, n in (("a", "alice", 2), ("b", "alice", 2), ("c", "bob", 2), ("d", "carol", 2),
                                  ("e", "alice", 1), ("f", "carol", 1))}
    alice = r.hget("{tokenbus}:gw:file:" + files["a"], "owner")
    _settled(r)
    try:
        # alice: what she holds and 2 batches' worth less a little (a record's timestamps vary by a few bytes);
        # everyone: what all hold and 3 batches' worth less as much
        per_key, total = _held(r, alice) + 2 * two - two // 20, _held(r) + 3 * two - two // 20
        _set(r, max_queued_bytes_per_key=per_key, max_queued_bytes=total)
        a1 = light_stack.create("alice", files["a"])
        light_stack.wait_status("alice", a1.id, ("in_progress",))
        with pytest.raises(openai.RateLimitError) as err:  # alice's 2 lines + 2 more > her 2 batches' worth
            light_stack.create("alice", files["b"])
        assert err.value.code == "queued_bytes_per_key_exceeded" and err.value.response.headers["retry-after"]
        b1 = light_stack.create("bob", files["c"])
        with pytest.raises(openai.RateLimitError) as err:  # 3 batches > 3 less a little for everyone
            light_stack.create("carol", files["d"])
        assert err.value.code == "queued_bytes_exceeded"
        assert len(r.keys("{tokenbus}:job:*")) == jobs_before + 4, "a refused batch wrote no job"
        # An ended batch gives its reservation back; what it keeps stays counted as Redis holds it (its job
        # records, its record, its error file's metadata: ~1.2 x the reservation here): a 1-line batch fits again.
        # The record and the file are also in the lists of what goes after batch_retention_s: an entry each more.
        light_stack.openai("alice").batches.cancel(a1.id)
        light_stack.wait_status("alice", a1.id, ("cancelled",))
        more = 2 * INDEX_ENTRY_BYTES
        _set(r, max_queued_bytes_per_key=per_key + more, max_queued_bytes=total + more)
        a2 = light_stack.create("alice", files["e"])
        # Redis itself: refused unless redis_reserve_bytes stay free under maxmemory.
        used = int(r.info("memory")["used_memory"])
        _set(r, max_queued_bytes_per_key=None, max_queued_bytes=None, redis_reserve_bytes=16 << 20)
        r.config_set("maxmemory", used + (16 << 20) - (256 << 10))  # above the reserve, but not by this batch
        with pytest.raises(openai.RateLimitError) as err:  # 16 MiB reserve > the 16 MiB - 256 KiB headroom
            light_stack.create("carol", files["f"])
        assert err.value.code == "redis_capacity"
    finally:
        r.config_set("maxmemory", 0)
        _set(r, max_queued_bytes_per_key=None, max_queued_bytes=None, redis_reserve_bytes=None)
    for who, b in (("bob", b1), ("alice", a2)):
        light_stack.openai(who).batches.cancel(b.id)


def test_redis_oom_during_ingest_fails_that_batch_only(light_stack, tmp_path):
    r, big_text = light_stack.r(), "Tell me about the sea. " * 40
    other = light_stack.batch("bob", [chat_line("keep", "Hi")], tmp_path)
    light_stack.wait_status("bob", other.id, ("in_progress",))
    light_stack.pause("tasks")  # the ingest runs after Redis has filled up meanwhile
    try:
        big = light_stack.batch("alice", [chat_line(f"o{i}", big_text) for i in range(2000)], tmp_path)
        r.config_set("maxmemory", int(r.info("memory")["used_memory"]) + 1024 * 1024)
    finally:
        light_stack.resume("tasks")
    try:
        done = light_stack.wait_status("alice", big.id, ("failed",), timeout=20)
        assert done.errors.data[0].code == "redis_out_of_memory", done.errors
        used_after = int(r.info("memory")["used_memory"])
        queued = [k for k in r.scan_iter(f"{{tokenbus}}:job:{big.id}-*", count=1000) if r.hget(k, "status") == "queued"]
        assert not queued and r.xlen(f"{{tokenbus}}:q:bulk:{big.id}") == 0, "the failed ingest's jobs still hold memory"
        assert used_after < int(r.config_get("maxmemory")["maxmemory"])
    finally:
        r.config_set("maxmemory", 0)
    # bob's batch and its queued job are untouched; the tasks process is alive and submits the next batch.
    assert light_stack.openai("bob").batches.retrieve(other.id).status == "in_progress"
    assert r.hget(f"{{tokenbus}}:job:{other.id}-0", "status") == "queued"
    light_stack.procs["tasks"].check_alive()
    nxt = light_stack.batch("alice", [chat_line("n", "Hi")], tmp_path)
    light_stack.wait_status("alice", nxt.id, ("in_progress",))
    for who, b in (("bob", other), ("alice", nxt)):
        light_stack.openai(who).batches.cancel(b.id)


def test_tasks_process_survives_redis_refusing_writes_and_exits_1_when_it_lasts(light_stack, tmp_path):
    r = light_stack.r()
    light_stack.pause("tasks")
    b = light_stack.batch("carol", [chat_line("w", "Hi")], tmp_path)
    r.config_set("maxmemory", 1)  # every write refused: RQ cannot even mark the submit started
    light_stack.resume("tasks")
    time.sleep(0.5)  # a few of RQ's writes fail and its worker quits; ours restarts it
    r.config_set("maxmemory", 0)
    light_stack.procs["tasks"].check_alive()
    light_stack.wait_status("carol", b.id, ("in_progress", "failed"), timeout=20)
    light_stack.openai("carol").batches.cancel(b.id)
    # Refused for longer than the restart backoff (4 x 0.3 s): the process gives up with exit code 1.
    proc = light_stack.procs["tasks"].proc
    light_stack.pause("tasks")
    b2 = light_stack.batch("carol", [chat_line("w2", "Hi")], tmp_path)
    r.config_set("maxmemory", 1)
    light_stack.resume("tasks")
    try:
        wait_until(lambda: proc.poll() is not None, 30, "the tasks process to give up", every=0.1)
    finally:
        r.config_set("maxmemory", 0)
    assert proc.returncode == 1, "Redis refusing writes for good must not look like a clean exit"
    light_stack.start("tasks")  # its supervisor restarts it: the lost submit is queued again
    light_stack.wait_status("carol", b2.id, ("in_progress",), timeout=20)
    light_stack.openai("carol").batches.cancel(b2.id)
