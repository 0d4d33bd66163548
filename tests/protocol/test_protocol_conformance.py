"""A client written from docs/protocol.md alone: plain Redis commands and the Lua files the doc links to
(includes expanded as the doc says), no `producer` or `protocol` import, against a real `python -m worker`
process (tiny random-weight model) on a real redis-server. Each step follows the doc's numbered operations;
if the doc and the worker disagree, this fails.
"""

from __future__ import annotations

import json
import re
import time

import pytest
import redis

from tests.protocol.doc_client import GROUP, PRIORITIES, DocClient, P, start_worker

WORKER = "conformance-worker"
VOCAB = 49_152  # the doc: "49 152 for SmolLM2" (the tiny test model has SmolLM2's tokenizer)
ID_RE = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9_.@-]{0,199}\Z")  # the doc's id rule


@pytest.fixture
def doc_client(redis_server):
    r = redis.Redis.from_url(redis_server.url, decode_responses=True, socket_timeout=30)
    yield DocClient(r)
    r.close()


def test_a_client_written_from_the_doc(doc_client, redis_server, serve_model_dir, worker_process):
    c, r = doc_client, doc_client.r
    c.create_group()
    c.create_group()  # BUSYGROUP is ignored

    # 1. submit: script and plain commands; idempotent; queue full; ids per the doc's rule
    greedy = {"prompt": "Hello there", "max_tokens": 4, "temperature": 0.0, "ignore_eos": True, "logprobs": 2}
    status, entry_id = c.submit("conf-1", greedy)
    assert status == 1 and c.record("conf-1")["entry_id"] == entry_id
    assert c.submit("conf-1", {"prompt": "other"}) == [0, "queued"], "the first request wins"
    assert c.submit("conf-full", greedy, max_queue_len=1, priority="bulk") == [-1, "1"], \
        "queue full (every queue counts): nothing written"
    with pytest.raises(redis.ResponseError, match="priority"):
        c.submit("conf-urgent", greedy, priority="urgent")
    assert not r.exists(f"{P}:job:conf-full")
    plain = {"prompt_token_ids": [1, 2, 3], "max_tokens": 6, "stream": True, "ignore_eos": True,
             "temperature": 0.0}
    assert c.submit_plain("conf-plain", plain) == "queued"
    assert c.submit_plain("conf-plain", {"prompt": "again"}) == "exists"
    rec = c.get("conf-plain")
    assert rec["status"] == "queued" and rec["entry_id"] and json.loads(rec["request"]) == plain, \
        "step 2 gave the record its entry: the request is found while it waits"
    assert "request" not in c.record("conf-plain") and "id" not in rec and "attempts" not in rec
    assert not ID_RE.match("abc\n") and not ID_RE.match("a:b") and ID_RE.match("conf-1")

    # 5. cancel while queued: ends at once, entry gone, no result
    c.submit("conf-cancel-queued", {"prompt": "never runs"})
    assert c.cancel("conf-cancel-queued") == "cancelled"
    rec = c.record("conf-cancel-queued")
    assert rec["status"] == "cancelled" and rec["error_code"] == "cancelled" and "result" not in rec

    # bad requests end with a final status and an event (the worker re-validates; vocabulary bound; model)
    c.submit("conf-vocab", {"prompt": "x", "stop_token_ids": [VOCAB], "min_tokens": 1, "max_tokens": 3})
    c.submit("conf-model", {"prompt": "x", "model": "gpt-4o-mini"})
    c.submit("conf-json", "not json")  # type: ignore[arg-type]  # JSON text of a string: not an object
    c.submit("bad id", {"prompt": "x"})  # the script checks no ids; the worker does
    c.submit("conf-ttl0", {"prompt": "keep me", "max_tokens": 2}, result_ttl=0)
    # a batch of two, as the doc's "Submitting a batch"
    bkey = f"{P}:batch:conf-batch"
    bqueue = f"{P}:q:bulk:conf-batch"
    r.hset(bkey, mapping={"id": "conf-batch", "status": "validating", "endpoint": "/v1/completions", "total": 2,
                          "finished": 0, "failed": 0, "cancelled": 0, "created_at": time.time(),
                          "priority": "bulk", "queue": bqueue})
    r.rpush(f"{bkey}:jobs", "conf-batch-0", "conf-batch-1")
    for i in range(2):
        c.submit(f"conf-batch-{i}", {"prompt": f"batch {i}", "max_tokens": 2, "priority": "bulk"},
                 batch_id="conf-batch", custom_id=f"c{i}", priority="bulk")
    assert r.zrange(f"{P}:queues:bulk", 0, -1) == [bqueue] and r.xlen(bqueue) == 2
    c.submit("conf-chat", {"prompt": "hi", "max_tokens": 2, "priority": "interactive"}, priority="interactive")
    assert c.eval("START_BATCH", [bkey], [time.time()]) == 1
    long_job = {"prompt": "long", "max_tokens": 900, "ignore_eos": True, "temperature": 0.0}
    c.submit("conf-cancel-running", long_job)

    started = time.time()
    start_worker(worker_process, redis_server.url, serve_model_dir, WORKER)
    deadline = time.monotonic() + 240
    while not (beat := r.get(f"{P}:worker:{WORKER}")):
        assert time.monotonic() < deadline, "no heartbeat"
        time.sleep(0.05)
    beat = json.loads(beat)
    fields = {"name", "pid", "model", "started_at", "last_seen", "running", "waiting", "free_blocks", "jobs_done",
              "draining", "prefix_queried_tokens", "prefix_hit_tokens", "prefix_queried_blocks", "prefix_hit_blocks",
              "used_blocks", "model_path", "backend", "device", "generated_tokens", "step_ms"}
    assert fields <= set(beat), f"the first heartbeat lacks {fields - set(beat)}"
    assert 0 < r.ttl(f"{P}:worker:{WORKER}") <= 10 and WORKER in r.smembers(f"{P}:workers")

    # 5. cancel while running: a partial result, finish_reason abort
    deadline = time.monotonic() + 120
    while not c.record("conf-cancel-running").get("first_token_at"):
        assert time.monotonic() < deadline, "the long job never started"
        time.sleep(0.05)
    assert c.cancel("conf-cancel-running") == "cancelling"
    assert "conf-cancel-running" in r.smembers(f"{P}:cancel")

    ids = ["conf-1", "conf-plain", "conf-vocab", "conf-model", "conf-json", "bad id", "conf-ttl0", "conf-batch-0",
           "conf-batch-1", "conf-cancel-running", "conf-chat"]
    ended = c.wait(ids)
    assert {j: ended[j]["status"] for j in ids} == {
        "conf-chat": "finished",
        "conf-1": "finished", "conf-plain": "finished", "conf-vocab": "failed", "conf-model": "failed",
        "conf-json": "failed", "bad id": "failed", "conf-ttl0": "finished", "conf-batch-0": "finished",
        "conf-batch-1": "finished", "conf-cancel-running": "cancelled"}
    codes = {j: ended[j].get("error_code") for j in ids if ended[j]["status"] != "finished"}
    assert codes == {"conf-vocab": "invalid_request", "conf-model": "model_mismatch",
                     "conf-json": "invalid_request", "bad id": "invalid_request",
                     "conf-cancel-running": "cancelled"}
    assert "vocabulary" in ended["conf-vocab"]["error"]

    # the record and the JobResult JSON
    rec = ended["conf-1"]
    assert rec["worker"] == WORKER and rec["attempts"] == "1"
    assert (rec["priority"], rec["queue"]) == ("default", f"{P}:q:default")
    # the interactive job, queued after everything else, was read before every default and bulk job but the
    # one bulk job of the seat kept for bulk work (the worker's bulk_min_fraction 0.25 of 4 seats: 1), which
    # intake may read first (docs/operations.md, bulk seats)
    assert float(ended["conf-chat"]["started_at"]) <= min(float(ended[j]["started_at"]) for j in
                                                          ("conf-1", "conf-plain", "conf-ttl0", "conf-batch-1"))
    assert float(rec["created_at"]) <= float(rec["started_at"]) <= float(rec["first_token_at"]) \
        <= float(rec["finished_at"])
    assert started - 5 < float(rec["started_at"])
    result = json.loads(rec["result"])
    assert result["finish_reason"] == "length" and len(result["token_ids"]) == 4
    assert result["usage"]["completion_tokens"] == 4 and result["usage"]["total_tokens"] == \
        result["usage"]["prompt_tokens"] + 4
    assert len(result["logprobs"]) == 4
    for token_id, entry in zip(result["token_ids"], result["logprobs"], strict=True):
        assert str(token_id) in entry and 2 <= len(entry) <= 3  # top 2 and the sampled token
        assert all(t in result["logprob_tokens"] for t in entry)
    assert all(set(v) == {"text", "bytes"} for v in result["logprob_tokens"].values())
    partial = json.loads(ended["conf-cancel-running"]["result"])
    assert partial["finish_reason"] == "abort" and 0 < len(partial["token_ids"]) < 900
    assert "conf-cancel-running" not in r.smembers(f"{P}:cancel")

    # 4. EXPIRE by result_ttl; 0 keeps the record
    assert 0 < r.ttl(f"{P}:job:conf-1") <= 60
    assert r.ttl(f"{P}:job:conf-ttl0") == -1

    # 3. streamed tokens: contiguous offsets, text parts join to the result's text, expire with the record
    chunks = [f for _id, f in r.xrange(f"{P}:job:conf-plain:tokens")]
    tokens, offset = [], 0
    for chunk in chunks:
        if int(chunk["offset"]) + len(json.loads(chunk["token_ids"])) <= offset and json.loads(chunk["token_ids"]):
            continue  # a chunk re-sent after an outage
        assert int(chunk["offset"]) == offset
        tokens += json.loads(chunk["token_ids"])
        offset = len(tokens)
    plain_result = json.loads(ended["conf-plain"]["result"])
    assert tokens == plain_result["token_ids"] and chunks[-1]["done"] == "1"
    assert "".join(ch["text"] for ch in chunks) == plain_result["text"]
    assert 0 < r.ttl(f"{P}:job:conf-plain:tokens") <= 60, "the token stream expires by the record's result_ttl"
    assert ended["conf-plain"]["entry_id"], "the worker's start set entry_id"

    # the batch ended through the counters
    batch = r.hgetall(bkey)
    assert (batch["status"], batch["finished"], batch["total"]) == ("completed", "2", "2")
    assert 0 < r.ttl(bkey) <= 60 and 0 < r.ttl(f"{bkey}:jobs") <= 60
    assert not r.exists(bqueue) and r.zcard(f"{P}:queues:bulk") == 0, "the ended batch's queue is gone"

    # dead letters: the invalid id (its record ended too); events: one per ended job
    dead = {f["job_id"]: f for _id, f in r.xrange(f"{P}:dead")}
    assert "malformed entry" in dead["bad id"]["reason"]
    events = [f["job_id"] for _id, f in r.xrange(f"{P}:events")]
    assert sorted(events) == sorted([*ids, "conf-cancel-queued"]), "exactly one event per ended job"
    # every ended job's entry is acknowledged and deleted: XLEN = queued + running = 0
    deadline = time.monotonic() + 10
    while c.depth()[0] or any(r.xpending(f"{P}:q:{p}", GROUP)["pending"] for p in PRIORITIES):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    ended_at = time.time()
    deadline = time.monotonic() + 10
    while (beat := json.loads(r.get(f"{P}:worker:{WORKER}")))["last_seen"] < ended_at + 0.1:
        assert time.monotonic() < deadline, "the heartbeat stopped"
        time.sleep(0.05)
    assert beat["running"] == beat["waiting"] == 0 and beat["jobs_done"] >= len(ids), beat
