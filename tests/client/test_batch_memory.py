"""`tokenbus batch submit` and export stream a batch file: the memory they hold does not grow with the file.

tracemalloc's peak over a whole submit (validation into the spool, then the pipelined enqueue into a real
redis-server) and over an export, of a small and a 3x larger file. Before the streaming submit every parsed
line stayed in memory (~3 KB a line); what is left growing is the custom_id table (producer/seen_ids.py,
12-50 B a line).
The 1M-line figures (RSS of every process) are in docs/bench_million.md.
"""

from __future__ import annotations

import json
import tracemalloc

from producer import Client
from producer.batches import export_batch, submit_batch
from protocol.scripts import finish_job

PER_LINE_BYTES = 100  # allowed growth of the peak per extra line


def write_file(path, n: int) -> None:
    with path.open("w") as f:
        for i in range(n):
            body = {"messages": [{"role": "user", "content": f"question {i}: " + "word " * 20}], "max_tokens": 8}
            f.write(
                json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})
                + "\n"
            )


def peak(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def submitted(url: str, path, n: int, measure: bool) -> tuple[Client, int]:
    write_file(path, n)
    client = Client(url, namespace=f"mem{n}", max_queue_len=0)
    used = (
        peak(lambda: submit_batch(client, path, batch_id=f"b{n}"))
        if measure
        else submit_batch(client, path, batch_id=f"b{n}") and 0
    )
    assert client.redis.hget(client.keys.batch(f"b{n}"), "total") == str(n)
    return client, used


def test_submit_memory_does_not_grow_with_the_file(redis_server, tmp_path):
    # 4,000 lines already fill the chunks in flight (producer/submit_pipe.py): what is constant is reached
    small, big = 4_000, 12_000
    peaks = {n: submitted(redis_server.url, tmp_path / f"in-{n}.jsonl", n, True)[1] for n in (small, big)}
    assert peaks[big] - peaks[small] < PER_LINE_BYTES * (big - small), peaks


def test_export_memory_does_not_grow_with_the_batch(redis_server, tmp_path):
    small, big = 1_500, 4_500
    peaks = {}
    for n in (small, big):
        client, _ = submitted(redis_server.url, tmp_path / f"in-{n}.jsonl", n, False)
        pipe = client.redis.pipeline(transaction=False)
        for i in range(n):  # every job finished, as a worker would end it
            finish_job(pipe, client.keys, f"b{n}-{i}", "finished", result={"text": "ok", "token_ids": [1]})
        pipe.execute()
        out = tmp_path / f"out-{n}.jsonl"
        peaks[n] = peak(lambda c=client, o=out, n=n: export_batch(c, f"b{n}", o))
        with out.open() as f:
            assert sum(1 for _ in f) == n
    assert peaks[big] - peaks[small] < PER_LINE_BYTES * (big - small), peaks
