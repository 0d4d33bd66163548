"""A client written from docs/protocol.md alone: plain Redis commands and the Lua files the doc links to
(includes expanded as the doc says), no `producer` or `protocol` import, against a real `python -m worker`
process (tiny random-weight model) on a real redis-server. Each step follows the doc's numbered operations;
if the doc and the worker disagree, this fails.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import redis

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"
NS = "tokenbus"
P = "{" + NS + "}"  # the doc: every key starts with the namespace in braces (a Redis Cluster hash tag)
GROUP = "workers"
EVENTS_MAXLEN = 100_000  # "XADD ... MAXLEN ~ 100000"
WORKER = "conformance-worker"
VOCAB = 49_152  # the doc: "49 152 for SmolLM2" (the tiny test model has SmolLM2's tokenizer)
PRIORITIES = ("interactive", "default", "bulk")  # the doc's Priorities, in the order workers serve them
ID_RE = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9_.@-]{0,199}\Z")  # the doc's id rule


def expand(path: Path, seen: set[Path]) -> str:
    """The doc: a line `-- #include _NAME.lua` stands for that file, itself expanded, each file at most once."""
    seen.add(path)
    out = []
    for line in path.read_text().splitlines(keepends=True):
        m = re.fullmatch(r"-- #include (_\w+\.lua)\n?", line)
        if m is None:
            out.append(line)
        elif path.parent / m.group(1) not in seen:
            out.append(expand(path.parent / m.group(1), seen))
    return "".join(out)


def doc_scripts() -> dict[str, str]:
    """The Script files table: | `NAME` | who | [file](link) |: the text to EVAL is the linked file, expanded."""
    rows = re.findall(r"^\| `(\w+)` \| (?:client|worker) \| \[[\w.]+\]\(([^)]+)\) \|$", DOC.read_text(), re.M)
    return {name: expand((DOC.parent / link).resolve(), set()) for name, link in rows}


def layout() -> str:
    """The layout ARGV, as the doc spells it out for the namespace."""
    def each(fmt: str):
        return {p: fmt.replace("{p}", p) for p in PRIORITIES}
    return json.dumps({"priorities": list(PRIORITIES), "default_priority": "default",
                       "queue": each(P + ":q:{p}"), "registry": each(P + ":queues:{p}"),
                       "turn": each(P + ":turn:{p}"), "ready": each(P + ":ready:{p}"),
                       "depth": f"{P}:depth", "wake": f"{P}:wake",
                       "batch_queue": {p: [f"{P}:q:{p}:", ""] for p in PRIORITIES},
                       "batch": [f"{P}:batch:", ""], "batch_jobs": [f"{P}:batch:", ":jobs"]})


class DocClient:
    """Everything a client needs, built from the doc's steps."""

    def __init__(self, r: redis.Redis) -> None:
        self.r = r
        self.scripts = doc_scripts()
        assert {"SUBMIT_JOB", "QUEUE_DEPTH", "CANCEL_JOB", "START_BATCH", "FINISH_JOB"} <= set(self.scripts)

    def eval(self, name: str, keys: list[str], args: list) -> object:
        text = self.scripts[name]
        return self.r.eval(text, len(keys), *keys, *args)

    # step 0
    def create_group(self) -> None:
        for priority in PRIORITIES:
            try:
                self.r.xgroup_create(f"{P}:q:{priority}", GROUP, id="0", mkstream=True)
            except redis.ResponseError as err:
                assert "BUSYGROUP" in str(err)

    # step 1
    def submit(self, job_id: str, request: dict, result_ttl: int = 60, max_queue_len: int = 0,
               batch_id: str = "", custom_id: str = "", priority: str = "default") -> list:
        queue = f"{P}:q:{priority}" + (f":{batch_id}" if batch_id else "")
        return self.eval("SUBMIT_JOB", [f"{P}:job:{job_id}", queue, f"{P}:queues:{priority}"],
                         [job_id, json.dumps(request), time.time(), max_queue_len, result_ttl, batch_id, custom_id,
                          priority, layout(), GROUP])

    def depth(self) -> int:
        return self.eval("QUEUE_DEPTH", [f"{P}:config"], [layout()])[0]  # KEYS only route it (the doc)

    def submit_plain(self, job_id: str, request: dict, result_ttl: int = 60) -> bool:
        """WATCH / EXISTS / QUEUE_DEPTH / MULTI XADD HINCRBY HSET / EXEC, as the doc spells it out."""
        key = f"{P}:job:{job_id}"
        with self.r.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(key)
                    if pipe.exists(key):
                        pipe.unwatch()
                        return False
                    self.depth()  # makes the counter if it is missing (and is the max_queue_len check)
                    pipe.multi()
                    pipe.xadd(f"{P}:q:default", {"job_id": job_id, "request": json.dumps(request)})
                    pipe.hincrby(f"{P}:depth", "default", 1)
                    pipe.hset(key, mapping={"id": job_id, "status": "queued", "request": json.dumps(request),
                                            "created_at": time.time(), "attempts": 0, "result_ttl": result_ttl,
                                            "priority": "default", "queue": f"{P}:q:default"})
                    pipe.execute()
                    return True
                except redis.WatchError:
                    continue

    # step 5
    def cancel(self, job_id: str) -> str:
        return self.eval("CANCEL_JOB", [f"{P}:job:{job_id}", f"{P}:events", f"{P}:cancel"],
                         [GROUP, job_id, time.time(), 604800, layout(), EVENTS_MAXLEN])

    def record(self, job_id: str) -> dict:
        return self.r.hgetall(f"{P}:job:{job_id}")

    # Waiting
    def wait(self, job_ids: list[str], timeout: float = 120) -> dict[str, dict]:
        last = self.r.xrevrange(f"{P}:events", count=1)
        last_id = last[0][0] if last else "0-0"
        ended = {j: self.record(j) for j in job_ids}
        ended = {j: rec for j, rec in ended.items() if rec.get("status") in ("finished", "failed", "cancelled")}
        deadline = time.monotonic() + timeout
        while len(ended) < len(job_ids):
            assert time.monotonic() < deadline, f"not ended: {set(job_ids) - set(ended)}"
            for _stream, entries in self.r.xread({f"{P}:events": last_id}, block=500) or []:
                for entry_id, fields in entries:
                    last_id = entry_id
                    if fields["job_id"] in job_ids:
                        ended[fields["job_id"]] = self.record(fields["job_id"])
        return ended


@pytest.fixture
def doc_client(redis_server):
    r = redis.Redis.from_url(redis_server.url, decode_responses=True, socket_timeout=30)
    yield DocClient(r)
    r.close()


def start_worker(worker_process, url: str, model: str):
    return worker_process("--redis-url", url, "--model", model, "--worker-name", WORKER, "--max-num-seqs", "4",
                          "--intake-lookahead", "2", "--max-num-batched-tokens", "256", "--kv-cache-gb", "0.05",
                          "--heartbeat-s", "0.5", "--lease-ms", "3000", "--cpu-kernels", "false")


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
    assert c.submit_plain("conf-plain", {"prompt_token_ids": [1, 2, 3], "max_tokens": 6, "stream": True,
                                         "ignore_eos": True, "temperature": 0.0})
    assert not c.submit_plain("conf-plain", {"prompt": "again"})
    assert c.record("conf-plain")["status"] == "queued" and "entry_id" not in c.record("conf-plain")
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
    start_worker(worker_process, redis_server.url, serve_model_dir)
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
    while c.depth() or any(r.xpending(f"{P}:q:{p}", GROUP)["pending"] for p in PRIORITIES):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    ended_at = time.time()
    deadline = time.monotonic() + 10
    while (beat := json.loads(r.get(f"{P}:worker:{WORKER}")))["last_seen"] < ended_at + 0.1:
        assert time.monotonic() < deadline, "the heartbeat stopped"
        time.sleep(0.05)
    assert beat["running"] == beat["waiting"] == 0 and beat["jobs_done"] >= len(ids), beat
