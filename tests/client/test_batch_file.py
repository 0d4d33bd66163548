"""One batch-file reader for the CLI and the gateway (producer/batch_file.py): the file read whole by
`tokenbus batch submit` and the same bytes streamed in chunks of any size, as the gateway's upload gets
them, give the same line numbers, the same messages and the same requests."""

from __future__ import annotations

import json
import random

import pytest

from producer.batch_file import BatchFileReader
from producer.batches import read_batch
from protocol.errors import InvalidBatch


def chat(cid: str, **body) -> str:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4} | body
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body})


def streamed(data: bytes, seed: int, **kwargs) -> BatchFileReader:
    reader, rng, at = BatchFileReader(**kwargs), random.Random(seed), 0
    while at < len(data):
        step = rng.randint(1, 40)
        reader.feed(data[at:at + step])
        at += step
    reader.close()
    return reader


def test_the_cli_and_a_chunked_upload_read_a_file_alike(tmp_path):
    lines = [chat("a"), "", "{not json", chat("b", temperature=-1), chat("a"),
             json.dumps({"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}})]
    # CRLF line ends, a U+2028 inside a line (str.splitlines ends a line there too), a line that is not UTF-8
    data = ("\r\n".join(lines) + "\r\n" + chat("d") + "\u2028" + chat("e")).encode() + b"\n\xff\xfe\n" + \
        chat("f").encode()
    (tmp_path / "b.jsonl").write_bytes(data)
    with pytest.raises(InvalidBatch) as err:
        read_batch(tmp_path / "b.jsonl")
    expect = [3, 4, 5, 6, 9]
    assert [n for n, _ in err.value.line_errors] == expect
    assert "line 5: custom_id 'a' already used on line 1" in str(err.value)
    assert "line 6: url /v1/completions differs from the batch's endpoint" in str(err.value)
    assert "line 9: not UTF-8 text (byte 1 of the line)" in str(err.value)
    for seed in range(5):
        reader = streamed(data, seed)
        assert reader.errors == err.value.line_errors
        assert reader.problem("nothing was submitted") == str(err.value)
    good = "\n".join(chat(c) for c in "xyz").encode()
    (tmp_path / "g.jsonl").write_bytes(good)
    endpoint, parsed, name = read_batch(tmp_path / "g.jsonl")
    assert (endpoint, [cid for cid, _ in parsed], name) == ("/v1/chat/completions", ["x", "y", "z"],
                                                            str(tmp_path / "g.jsonl"))
    assert streamed(good, 0, keep=True).parsed == parsed == read_batch(good.decode().splitlines())[1]


def test_a_line_over_the_limit_is_one_error_and_the_rest_still_counts():
    data = (chat("a") + "\n" + chat("b", stop=["x" * 500]) + "\n" + chat("c")).encode()
    reader = streamed(data, 1, max_line_bytes=300)
    assert [n for n, _ in reader.errors] == [2] and "longer than 300 bytes" in reader.errors[0][1]
    assert reader.requests == 3 and reader.problem("the file was not stored").startswith(
        "1 of 3 lines are invalid; the file was not stored:\n  line 2:")


def embed(cid: str, value, model: str = "all-minilm-l6-v2") -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/embeddings",
                       "body": {"model": model, "input": value}})


def test_embedding_lines_are_checked_once_and_counted_per_input():
    """Each embedding line's `input` is checked as it is read (the only check: a JobRequest's embed_inputs does
    not check again), a bad one failing its line alone, and the good ones are counted per input: one vector of
    1,024 floats reserved each, tokens ~ bytes / 4 + 1 (or the ids). Model names are checked on every line, the
    same name's verdict remembered."""
    lines = [embed("one", "a text"), embed("two", ["a", "bb"]), embed("ids", [1, 2, 3]),
             embed("lists", [[1, 2], [3]]), embed("empty", ""), embed("none", []), embed("mixed", ["a", [1]]),
             embed("neg", [[1, -1]]), embed("bad-model", "x", model="a:b"), embed("bad-model-2", "y", model="a:b")]
    reader = streamed("\n".join(lines).encode(), 3, keep=True)
    assert [n for n, _ in reader.errors] == [5, 6, 7, 8, 9, 10]
    shown = "\n".join(msg for _, msg in reader.errors)
    for why in ("input is an empty string", "input must not be an empty list", "mixes strings and token-id lists",
                "token ids must be >= 0", "a model name holds no ':'"):
        assert why in shown
    seats = {cid: (request.seats, request.embed_inputs()) for cid, request in reader.parsed}
    assert seats == {"one": (1, ["a text"]), "two": (2, ["a", "bb"]), "ids": (1, [[1, 2, 3]]),
                     "lists": (2, [[1, 2], [3]])}
    assert reader.result_bytes == 6 * 1024 * 4
    assert reader.tokens == (6 // 4 + 1) + (1 // 4 + 1) + (2 // 4 + 1) + 3 + 2 + 1
