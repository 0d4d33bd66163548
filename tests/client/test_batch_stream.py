"""The streaming submit's two halves against a real redis-server: SUBMIT_JOBS with calls in flight
(producer/submit_pipe.py) and the submit of a spool kept from its validation (the gateway's upload)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import redis

from producer import Client, InvalidBatch, InvalidJob
from producer.batch_file import BatchFileReader
from producer.batch_spool import open_spool, spool_writer
from producer.batches import submit_batch
from producer.openai_batch import submit_fields
from producer.submit_pipe import SubmitPipe
from protocol import scripts
from protocol.models import GROUP
from protocol.priority import Priority
from protocol.scripts import PendingJob


def lines(n: int, bad_at: int | None = None) -> str:
    out = []
    for i in range(n):
        body = {"messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": 4}
        if i == bad_at:
            body["temperature"] = -1
        out.append(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}))
    return "\n".join(out) + "\n"


def entries(client: Client, batch_id: str) -> list[tuple[str, str]]:
    """(custom_id, request JSON) of every queued job of the batch, in input order."""
    stream = client.redis.xrange(client.keys.queue("bulk", batch_id))
    customs = [client.redis.hget(client.keys.job(f["job_id"]), "custom_id") for _, f in stream]
    return list(zip(customs, [f["request"] for _, f in stream], strict=True))


def spool_of(path: Path, lines_text: str) -> Path:
    """The spool the gateway's upload writes as it validates (gateway/files/store.py)."""
    with path.open("w", encoding="utf-8") as f:
        reader = BatchFileReader(on_request=spool_writer(f), overrides=submit_fields(None, Priority.bulk))
        reader.feed(lines_text.encode())
        reader.close()
    assert not reader.error_count
    return path


def test_a_kept_spool_is_sent_alike_unread_and_a_changed_one_is_refused(redis_server, tmp_path):
    client = Client(redis_server.url, max_queue_len=0)
    path = tmp_path / "in.jsonl"
    path.write_text(lines(2500))
    submit_batch(client, path, batch_id="spooled")
    kept = spool_of(tmp_path / "in.requests", lines(2500))
    path.write_text("not even JSON\n")  # what a kept spool is sent from is the spool alone
    rec = submit_batch(client, open_spool(kept, "/v1/chat/completions", 2500, "bulk"), batch_id="kept")
    assert rec.total == 2500 and rec.status.value == "in_progress"
    assert entries(client, "kept") == entries(client, "spooled") and len(entries(client, "spooled")) == 2500

    spool_of(kept, lines(2400))  # changed since: found at its end, after the jobs before were written
    with pytest.raises(InvalidBatch, match="the spool holds 2400 requests, not 2500"):
        submit_batch(client, open_spool(kept, "/v1/chat/completions", 2500, "bulk"), batch_id="shorter")
    assert 0 < client.redis.xlen(client.keys.queue("bulk", "shorter")) <= 2400  # the caller removes them
    with pytest.raises(InvalidBatch, match="created with priority bulk; these requests were validated for default"):
        submit_batch(client, open_spool(kept, "/v1/chat/completions", 2500, "default"), batch_id="shorter")
    # without a spool a bad line refuses the file before anything is written
    path.write_text(lines(2500, bad_at=2200))
    with pytest.raises(InvalidBatch, match="1 of 2500 lines are invalid; nothing was submitted"):
        submit_batch(client, path, batch_id="refused")
    assert not client.redis.exists(client.keys.batch("refused"), client.keys.queue("bulk", "refused"))


def test_chunks_in_flight_survive_redis_forgetting_the_script(redis_server):
    client = Client(redis_server.url, max_queue_len=0)
    done: list[int] = []
    with SubmitPipe(client.redis, client.keys, 0, 60, chunk_size=50, depth=3, on_chunk=done.append) as pipe:
        for i in range(400):
            if i == 120:  # chunks in flight; the next EVALSHAs answer NOSCRIPT, as after a Redis restart
                client.redis.script_flush()
            pipe.add(PendingJob(f"j{i}", json.dumps({"prompt": f"p{i}"})))
        assert pipe.close() == 400
    assert sum(done) == 400
    stream = client.redis.xrange(client.keys.queue())
    assert [f["job_id"] for _, f in stream] == [f"j{i}" for i in range(400)]  # each once, in order


def test_one_submit_jobs_call_writes_each_job_as_submit_job_would(redis_server):
    """SUBMIT_JOBS (many jobs of one queue a call) against docs/protocol.md's SUBMIT_JOB: each record, entry,
    counter and registry as one SUBMIT_JOB a job writes them; a taken id, an existing job and a full queue
    refuse only their own job; an error reply writes nothing."""
    client = Client(redis_server.url, max_queue_len=0)
    k, r = client.keys, client.redis
    client.submit("plain", job_id="b-3")  # a loose job holds batch b's fourth id
    queue, registry = k.queue("bulk", "b"), k.registry("bulk")
    submit = scripts.script(scripts.SUBMIT_JOBS)

    def call(ids: list[str], limit: int = 0, customs: list[str] | None = None) -> list:
        customs = customs or [f"c{j}" for j in ids]
        triples = [x for jid, cid in zip(ids, customs, strict=True) for x in (jid, json.dumps({"prompt": jid}), cid)]
        return submit(keys=[k.job(j) for j in ids],
                      args=[time.time(), limit, 60, "b", "bulk", k.layout, GROUP, "", *triples], client=r)

    out = call(["b-0", "b-1", "b-2", "b-3", "b-4"], customs=["c0", "", "c2", "c3", "c4"])
    assert [code for code, _ in out] == [1, 1, 1, -2, 1] and out[3][1] == ""
    stream = r.xrange(queue)
    assert [(e, f) for e, f in stream] == [
        (out[i][1], {"job_id": f"b-{i}", "request": json.dumps({"prompt": f"b-{i}"})}) for i in (0, 1, 2, 4)]
    rec = r.hgetall(k.job("b-0"))
    assert list(rec) == ["status", "created_at", "result_ttl", "entry_id", "queue", "priority", "batch_id",
                         "custom_id"]
    assert {f: rec[f] for f in ("status", "result_ttl", "entry_id", "queue", "priority", "batch_id", "custom_id")} \
        == {"status": "queued", "result_ttl": "60", "entry_id": out[0][1], "queue": queue, "priority": "bulk",
            "batch_id": "b", "custom_id": "c0"}
    assert "custom_id" not in r.hgetall(k.job("b-1")) and r.object("encoding", k.job("b-0")) == "listpack"
    assert r.hget(k.job("b-3"), "batch_id") is None  # the loose job is left as it was
    # the loose job and four of b's, in the queues and in the depth counter
    assert scripts.queue_totals(r, k) == (5, 0) and scripts.depth(r, k).total == 5
    assert r.zscore(registry, queue) is not None and r.zscore(k.ready("bulk"), queue) == r.zscore(registry, queue)
    assert [f["queue"] for _, f in r.xrange(k.wake)] == [queue]
    # again, with two more: the written ones answer {0, status}, and the queue fills after one more job
    out = call(["b-0", "b-5", "b-6", "b-7"], limit=6)
    assert out == [[0, "queued"], [1, out[1][1]], [-1, "6"], [-1, "6"]]
    assert scripts.queue_totals(r, k) == (6, 0) and scripts.depth(r, k).total == 6 and not r.exists(k.job("b-6"))
    assert [f["queue"] for _, f in r.xrange(k.wake)] == [queue]  # it was ready already: no second wake
    with pytest.raises(redis.ResponseError, match="priority must be one of"):
        submit(keys=[k.job("b-8")],
               args=[time.time(), 0, 60, "b", "urgent", k.layout, GROUP, "", "b-8", "{}", ""], client=r)
    with pytest.raises(redis.ResponseError, match="1 records need 11 ARGV, got 10"):
        submit(keys=[k.job("b-8")],
               args=[time.time(), 0, 60, "b", "bulk", k.layout, GROUP, "", "b-8", "{}"], client=r)
    assert not r.exists(k.job("b-8")) and scripts.queue_totals(r, k) == (6, 0)


def test_the_pipe_splits_its_calls_by_queue_and_names_a_refused_job(redis_server):
    client = Client(redis_server.url, max_queue_len=0)
    with SubmitPipe(client.redis, client.keys, 0, 60, chunk_size=4) as pipe:
        for i in range(10):  # loose and batch jobs interleaved: one call never mixes queues
            pipe.add(PendingJob(f"j{i}", json.dumps({"prompt": "p"}), "b" if i % 3 else "", "", "bulk"))
        assert pipe.close() == 10
    assert client.redis.xlen(client.keys.queue("bulk")) == 4
    assert [f["job_id"] for _, f in client.redis.xrange(client.keys.queue("bulk", "b"))] == \
        [f"j{i}" for i in range(10) if i % 3]
    with pytest.raises(InvalidJob, match="job id 'j0' of batch 'c' is taken"), \
            SubmitPipe(client.redis, client.keys, 0, 60) as pipe:
        pipe.add(PendingJob("j0", json.dumps({"prompt": "p"}), "c", "", "bulk"))
        pipe.close()
