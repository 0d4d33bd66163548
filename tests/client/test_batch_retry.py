"""`tokenbus batch retry ID`: a new batch of an ended batch's unfinished lines (failed, cancelled, never run),
copied from its input file with their custom_ids, the two records linked; and a batch's token counts, summed
by FINISH_JOB as its jobs end, in `tokenbus batch status`. Real redis-server; jobs ended with the worker's Lua."""

from __future__ import annotations

import json

import pytest

from producer import batches
from producer.batch_retry import NothingToRetry, unfinished_lines
from producer.cli import build_parser, run
from producer.client import Client
from protocol.scripts import finish_job
from tests.client.test_batches import chat_line, run_jobs


@pytest.fixture
def client(redis_server):
    with Client(redis_server.url) as c:
        yield c


def test_retry_reruns_the_unfinished_lines_and_links_the_batches(client, redis_server, tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join([chat_line("a"), "", chat_line("b"), chat_line("c"), chat_line("d")]) + "\n")
    first = batches.submit_batch(client, src)
    with pytest.raises(NothingToRetry):  # not ended yet
        unfinished_lines(client, first.id)
    run_jobs(client, {"a": "finished", "b": "failed", "c": "finished"})  # d is left running
    batches.cancel_batch(client, first.id)
    d = f"{first.id}-3"  # the worker aborts it, as it does a cancelled running job
    entry, queue = client.redis.hmget(client.keys.job(d), "entry_id", "queue")
    finish_job(client.redis, client.keys, d, "cancelled", entry_id=entry, queue=queue)
    ended = batches.get_batch(client, first.id)
    assert ended.status == "cancelled" and ended.finished == 2
    assert (ended.input_tokens, ended.output_tokens, ended.cached_tokens) == (8, 4, 0), "two results' usage"

    # the CLI's command (run: main would also point structlog at this test's captured stderr, for good)
    assert run(build_parser().parse_args(["--url", redis_server.url, "batch", "retry", first.id])) == 0
    retry_id = capsys.readouterr().out.strip().splitlines()[-1]
    retry = batches.get_batch(client, retry_id)
    assert retry.total == 2 and retry.retry_of == first.id
    assert batches.get_batch(client, first.id).retried_by == retry_id
    copied = [json.loads(x)["custom_id"] for x in open(retry.input_file)]
    assert copied == ["b", "d"], "the unfinished lines, in input order, blank lines skipped"
    run_jobs(client, {"b": "finished", "d": "finished"})
    assert batches.get_batch(client, retry_id).status == "completed"
    with pytest.raises(NothingToRetry):
        unfinished_lines(client, retry_id)

    assert run(build_parser().parse_args(["--url", redis_server.url, "batch", "status", retry_id])) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["input_tokens"] == 8 and status["output_tokens"] == 4 and status["retry_of"] == first.id
