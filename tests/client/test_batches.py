"""OpenAI Batch files: validation, batch records and counts, cancel, wait, export, and the batch CLI.

A real redis-server; the worker is played by the shared scripts (start_job / finish_job)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import redis

from producer import Client, InvalidBatch, QueueFull, TokenbusError
from producer.batches import cancel_batch, export_batch, get_batch, submit_batch, wait_batch
from producer.openai_batch import parse_line
from protocol.models import GROUP, BatchStatus, JobResult, JobStatus
from protocol.scripts import finish_job, queue_streams, queue_totals, start_job

ROOT = Path(__file__).resolve().parents[2]


def chat_line(cid: str, text: str = "hi", **body) -> str:
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": text}], "max_tokens": 8} | body
    body = {k: v for k, v in body.items() if v is not None}  # None: leave the field out
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body})


def completion_line(cid: str, prompt, **body) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/completions",
                       "body": {"model": "smollm2-135m", "prompt": prompt} | body})


@pytest.fixture
def client(redis_server):
    with Client(redis_server.url) as c:
        yield c


def read_entries(c: Client, count: int | None = None) -> list[tuple[str, str, dict[str, str]]]:
    """XREADGROUP on every queue, as a worker's intake reads them: [(queue, entry id, fields)]."""
    out = []
    for queues in queue_streams(c.redis, c.keys).values():
        for q in queues:
            if count is not None and len(out) >= count:
                return out
            try:
                resp = c.redis.xreadgroup(GROUP, "w1", {q: ">"}, count=None if count is None else count - len(out))
            except redis.ResponseError:  # no such queue
                continue
            out += [(q, entry_id, fields) for _s, entries in resp or [] for entry_id, fields in entries]
    return out


def run_jobs(c: Client, outcomes: dict[str, str]) -> None:
    """Play a worker: deliver all entries, then end each job as outcomes[custom_id] says."""
    for queue, entry_id, fields in read_entries(c):
        jid = fields["job_id"]
        if start_job(c.redis, c.keys, jid, entry_id, "w1", queue)[0] != "running":
            continue
        custom_id = c.get(jid).custom_id
        outcome = outcomes.get(custom_id)
        if outcome == "finished":
            res = JobResult(text=f"answer to {custom_id}", token_ids=[5, 6], finish_reason="stop",
                            usage={"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6},
                            model="smollm2-135m")
            finish_job(c.redis, c.keys, jid, "finished", entry_id=entry_id, queue=queue, result=res)
        elif outcome == "failed":
            finish_job(c.redis, c.keys, jid, "failed", entry_id=entry_id, queue=queue, error="prompt too long",
                       error_code="invalid_request")


def fields_of(text: str) -> dict:
    return parse_line(text)[1].model_dump(exclude_none=True)


def test_parse_line_maps_openai_fields():
    f = fields_of(chat_line("a", max_tokens=None, max_completion_tokens=12, logprobs=True, top_logprobs=3,
                                seed=1, n=1, user="u", stop="END"))
    assert f["max_tokens"] == 12 and f["logprobs"] == 3 and f["seed"] == 1 and f["stop"] == "END"
    assert "user" not in f and f["n"] == 1
    content = [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]
    parts = [{"role": "developer", "content": content}]
    f = fields_of(chat_line("b", messages=parts))
    assert f["messages"] == [{"role": "system", "content": "be brief"}]
    f = fields_of(completion_line("c", [1, 2, 3], logprobs=2, echo=False))
    assert f["prompt_token_ids"] == [1, 2, 3] and f["logprobs"] == 2
    f = fields_of(completion_line("d", ["one prompt"]))
    assert f["prompt"] == "one prompt"


def test_batch_round_trip_counts_and_export(client, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join([chat_line("req-a", "one"), "", chat_line("req-b", "two", temperature=0.0),
                              chat_line("req-c", "three", max_completion_tokens=4, max_tokens=None)]) + "\n")
    rec = client.submit_batch(src)
    assert (rec.status, rec.total, rec.done) == (BatchStatus.in_progress, 3, 0)
    assert rec.endpoint == "/v1/chat/completions"
    assert rec.input_file == str(src)
    jobs = client.get_many([f"{rec.id}-{i}" for i in range(3)])
    assert [j.custom_id for j in jobs] == ["req-a", "req-b", "req-c"]
    assert {j.batch_id for j in jobs} == {rec.id} and jobs[2].request["max_tokens"] == 4

    run_jobs(client, {"req-a": "finished", "req-b": "failed"})
    rec = get_batch(client, rec.id)
    assert (rec.status, rec.finished, rec.failed, rec.cancelled) == (BatchStatus.in_progress, 1, 1, 0)
    with pytest.raises(TokenbusError, match="in_progress .2/3 jobs ended.; wait for it"):
        export_batch(client, rec.id, tmp_path / "out.jsonl")
    assert export_batch(client, rec.id, tmp_path / "partial.jsonl", allow_partial=True) == 2

    # req-c was started by run_jobs above; end it without an entry id (the record's is used).
    finish_job(client.redis, client.keys, f"{rec.id}-2", "finished",
               result=JobResult(text="three!", finish_reason="length", usage={"completion_tokens": 4}))
    rec = get_batch(client, rec.id)
    assert (rec.status, rec.finished, rec.failed, rec.done) == (BatchStatus.completed, 2, 1, 3)
    assert rec.completed_at >= rec.in_progress_at >= rec.created_at
    assert 0 < client.redis.ttl(client.keys.batch(rec.id)) <= client.result_ttl

    out = tmp_path / "out.jsonl"
    assert client.export_batch(rec.id, out) == 3
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["custom_id"] for x in lines] == ["req-a", "req-b", "req-c"]
    ok = lines[0]
    assert ok["id"] == f"batch_req_{rec.id}-0" and ok["error"] is None
    assert ok["response"]["status_code"] == 200
    body = ok["response"]["body"]
    assert body["object"] == "chat.completion" and body["model"] == "smollm2-135m"
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "answer to req-a"},
                                "logprobs": None, "finish_reason": "stop"}]
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert isinstance(body["created"], int)
    assert lines[1]["response"] is None
    assert lines[1]["error"] == {"code": "invalid_request", "message": "prompt too long"}
    assert lines[2]["response"]["body"]["choices"][0]["finish_reason"] == "length"


def test_completions_batch_exports_text_completion(client, tmp_path):
    rec = client.submit_batch([completion_line("x", "Once upon"), completion_line("y", [1, 2, 3])],
                              model="")  # "" drops body.model
    assert client.get(f"{rec.id}-0").request == {"prompt": "Once upon", "priority": "bulk"}
    assert client.get(f"{rec.id}-1").request == {"prompt_token_ids": [1, 2, 3], "priority": "bulk"}
    run_jobs(client, {"x": "finished", "y": "finished"})
    export_batch(client, rec.id, tmp_path / "o.jsonl")
    body = json.loads((tmp_path / "o.jsonl").read_text().splitlines()[0])["response"]["body"]
    assert body["object"] == "text_completion" and body["id"] == f"cmpl-{rec.id}-0"
    assert body["choices"] == [{"index": 0, "text": "answer to x", "finish_reason": "stop", "logprobs": None}]


def test_bad_jsonl_is_rejected_with_line_numbers_and_nothing_written(client, tmp_path):
    lines = [
        chat_line("ok-1"),                                                   # 1
        "{not json",                                                         # 2
        chat_line("ok-2", frequency_penality=0.5),                           # 3 unknown body field
        chat_line("ok-3", n=33),                                             # 4 n over MAX_CHOICES
        json.dumps({"custom_id": "m", "method": "GET", "url": "/v1/chat/completions", "body": {}}),  # 5
        chat_line("ok-1"),                                                   # 6 duplicate custom_id
        completion_line("ok-7", "x"),                                        # 7 other endpoint
        chat_line("ok-8", temperature=-1),                                   # 8
        json.dumps({"custom_id": "ok-9", "method": "POST", "url": "/v1/chat/completions", "body": {},
                    "extra": 1}),                                            # 9
    ]
    (tmp_path / "bad.jsonl").write_text("\n".join(lines))
    with pytest.raises(InvalidBatch) as err:
        submit_batch(client, tmp_path / "bad.jsonl")
    numbers = [n for n, _ in err.value.line_errors]
    assert numbers == [2, 3, 4, 5, 6, 7, 8, 9]
    msg = str(err.value)
    assert msg.startswith("8 of 9 lines are invalid; nothing was submitted")
    assert "line 3: body: unknown field(s) frequency_penality for /v1/chat/completions" in msg
    assert "line 4: body: n: Input should be less than or equal to 32" in msg
    assert "line 6: custom_id 'ok-1' already used on line 1" in msg
    assert "line 8: body: temperature: Input should be greater than or equal to 0" in msg
    assert "line 9: extra: unknown field" in msg
    assert client.redis.keys("*") == []
    with pytest.raises(InvalidBatch, match="no requests"):
        submit_batch(client, ["", "  "])
    with pytest.raises(InvalidBatch, match="does not exist"):
        submit_batch(client, tmp_path / "missing.jsonl")


def test_batch_resubmit_with_same_id_is_idempotent(client):
    lines = [chat_line(f"c{i}") for i in range(4)]
    first = submit_batch(client, lines, batch_id="nightly-1")
    again = submit_batch(client, lines, batch_id="nightly-1")
    assert first.id == again.id == "nightly-1" and queue_totals(client.redis, client.keys)[0] == 4
    with pytest.raises(InvalidBatch, match="already exists with 4"):
        submit_batch(client, lines[:2], batch_id="nightly-1")


def test_cancel_batch(client):
    rec = client.submit_batch([chat_line(f"c{i}") for i in range(3)])
    queue, entry_id, fields = read_entries(client, count=1)[0]
    running = fields["job_id"]
    start_job(client.redis, client.keys, running, entry_id, "w1", queue)
    rec = cancel_batch(client, rec.id)
    assert (rec.status, rec.cancelled) == (BatchStatus.cancelling, 2)
    assert client.redis.sismember(client.keys.cancel, running)
    finish_job(client.redis, client.keys, running, "cancelled", entry_id=entry_id, queue=queue, error="aborted",
               error_code="cancelled")
    rec = client.get_batch(rec.id)
    assert (rec.status, rec.cancelled, rec.done) == (BatchStatus.cancelled, 3, 3)
    assert queue_totals(client.redis, client.keys) == (0, 0)
    assert not client.redis.exists(queue), "an ended batch's empty queue is deleted"
    assert client.redis.zcard(client.keys.registry("bulk")) == 0, "and leaves the registry"
    assert client.cancel_batch(rec.id).status == BatchStatus.cancelled  # a no-op now


def test_wait_batch_reports_progress(client):
    rec = client.submit_batch([chat_line(f"c{i}") for i in range(3)])
    resp = read_entries(client)

    def worker():
        for queue, entry_id, fields in resp:
            start_job(client.redis, client.keys, fields["job_id"], entry_id, "w1", queue)
            finish_job(client.redis, client.keys, fields["job_id"], "finished", entry_id=entry_id, queue=queue,
                       result=JobResult(text="x"))
            threading.Event().wait(0.3)

    seen: list[int] = []
    t = threading.Thread(target=worker)
    t.start()
    final = wait_batch(client, rec.id, timeout=15, on_progress=lambda r: seen.append(r.done))
    t.join()
    assert final.status == BatchStatus.completed and final.finished == 3
    assert seen == sorted(seen) and seen[-1] == 3 and len(set(seen)) >= 3


def test_cli_batch_submit_status_wait_export(redis_server, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "producer", "--url", redis_server.url, *args],
                              capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)

    (tmp_path / "in.jsonl").write_text(chat_line("a") + "\n" + chat_line("b") + "\n")
    sub = cli("batch", "submit", str(tmp_path / "in.jsonl"), "--batch-id", "b1")
    assert sub.returncode == 0, sub.stderr
    assert sub.stdout.strip() == "b1"
    assert json.loads(cli("batch", "status", "b1").stdout)["total"] == 2
    c = Client(redis_server.url)
    run_jobs(c, {"a": "finished", "b": "finished"})
    waited = cli("batch", "wait", "b1", "--timeout", "10")
    assert waited.returncode == 0 and json.loads(waited.stdout)["status"] == "completed"
    assert "2/2" in waited.stderr  # the progress bar
    exported = cli("batch", "export", "b1", str(tmp_path / "out.jsonl"))
    assert exported.returncode == 0 and "wrote 2 lines" in exported.stderr
    out_lines = (tmp_path / "out.jsonl").read_text().splitlines()
    assert [json.loads(x)["custom_id"] for x in out_lines] == ["a", "b"]
    (tmp_path / "bad.jsonl").write_text(chat_line("a", n=33) + "\n")
    bad = cli("batch", "submit", str(tmp_path / "bad.jsonl"))
    assert bad.returncode == 1 and "line 1: body: n:" in bad.stderr and "Traceback" not in bad.stderr
    assert c.get("b1-0").status == JobStatus.finished


def test_cancel_batch_counts_jobs_that_were_never_submitted(client):
    rec = client.submit_batch([chat_line(f"c{i}") for i in range(3)])
    # As if the submit was interrupted before job 2 was written.
    lost = f"{rec.id}-2"
    client.redis.xdel(client.get(lost).queue, client.get(lost).entry_id)
    client.redis.delete(client.keys.job(lost))
    rec = cancel_batch(client, rec.id)
    assert (rec.status, rec.cancelled, rec.done) == (BatchStatus.cancelled, 3, 3)


def test_info_and_the_queue_limit_count_every_queue_by_priority(redis_server):
    from producer.cli import format_info

    c = Client(redis_server.url, max_queue_len=7)
    c.submit("now", priority="interactive")
    c.submit_many([{"prompt": "a"}, {"prompt": "b"}])
    rec = c.submit_batch([chat_line(f"c{i}") for i in range(3)], batch_id="nightly")
    assert (rec.priority, rec.queue) == ("bulk", c.keys.queue("bulk", "nightly"))
    c.submit_batch([chat_line("x")], batch_id="urgent", priority="default")
    info = c.info()
    assert info.by_priority == {"interactive": 1, "default": 3, "bulk": 3}
    assert (info.queue_depth, info.queues, info.waiting) == (7, 4, 7)
    assert "interactive 1  default 3  bulk 3  (4 non-empty queues)" in format_info(info)
    with pytest.raises(QueueFull):  # 7 queued over four queues: the limit counts them all
        c.submit("one more", priority="bulk")
    with pytest.raises(QueueFull, match="nothing was submitted"):
        c.submit_batch([chat_line("y")], batch_id="late")


def test_export_of_an_n_job_lists_every_choice():
    from producer.openai_batch import CHAT, COMPLETIONS, response_body
    from protocol.models import Job

    result = {"text": "a", "token_ids": [1], "finish_reason": "stop", "usage": {"completion_tokens": 3},
              "choices": [{"index": 0, "text": "a", "token_ids": [1], "finish_reason": "stop"},
                          {"index": 1, "text": "bc", "token_ids": [2, 3], "finish_reason": "length"}]}
    job = Job(id="j", status=JobStatus.finished, result=JobResult.model_validate(result), request={"n": 2})
    chat = response_body(job, CHAT)["choices"]
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in chat] == [
        (0, "a", "stop"), (1, "bc", "length")]
    completion = response_body(job, COMPLETIONS)["choices"]
    assert [(c["index"], c["text"]) for c in completion] == [(0, "a"), (1, "bc")]
    # a result from a worker that writes no `choices` still exports its one choice
    old = Job(id="k", status=JobStatus.finished, result=JobResult(text="x", finish_reason="stop"))
    assert [c["text"] for c in response_body(old, COMPLETIONS)["choices"]] == ["x"]
