"""Batch export with logprobs (#13 item 9): a real worker (in-process Server, tiny real Engine) writes each
token's text and bytes into the result, and the export gives OpenAI's logprobs shapes from them."""

from __future__ import annotations

import json

from producer import Client
from producer.batches import wait_batch


def line(cid: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


def export(client: Client, lines: list[str], tmp_path, name: str) -> list[dict]:
    rec = client.submit_batch(lines)
    rec = wait_batch(client, rec.id, timeout=120)
    assert rec.status == "completed" and rec.finished == len(lines), rec
    out = tmp_path / f"{name}.jsonl"
    client.export_batch(rec.id, out)
    return [json.loads(x) for x in out.read_text().splitlines()]


def test_token_bytes_round_trip_the_text(serve_engine):
    from worker.engine.token_text import token_bytes, token_info

    tok = serve_engine.tokenizer
    text = "Hello wörld 😀 naïve"
    ids = tok.encode(text)
    assert b"".join(token_bytes(tok, i) for i in ids) == text.encode()
    info = token_info(tok, ids)
    split_emoji = [i for i in ids if info[str(i)]["text"] == "\ufffd"]
    assert split_emoji, "the emoji spans tokens: each holds part of its bytes"
    assert all(len(info[str(i)]["bytes"]) < 4 for i in split_emoji)


def test_export_gives_openai_logprobs(serve_engine, serve, redis_server, tmp_path):
    serve(serve_engine)
    client = Client(redis_server.url)
    tok = serve_engine.tokenizer
    chat = "/v1/chat/completions"
    msgs = [{"role": "user", "content": "Say something"}]
    rows = export(client, [
        line("top2", chat, {"messages": msgs, "max_tokens": 6, "logprobs": True, "top_logprobs": 2,
                            "ignore_eos": True, "temperature": 0}),
        line("plain", chat, {"messages": msgs, "max_tokens": 3, "logprobs": True, "ignore_eos": True}),
        line("none", chat, {"messages": msgs, "max_tokens": 3}),
    ], tmp_path, "chat")
    for row, top_n in zip(rows[:2], (2, 0), strict=True):
        job = client.get(row["response"]["request_id"])
        lp = row["response"]["body"]["choices"][0]["logprobs"]
        content = lp["content"]
        assert len(content) == len(job.result.token_ids) == job.result.usage.completion_tokens
        raw = b"".join(bytes(c["bytes"]) for c in content)
        assert raw.decode("utf-8", "replace") == tok.decode(job.result.token_ids, skip_special_tokens=False)
        for c, token_id, entry in zip(content, job.result.token_ids, job.result.logprobs, strict=True):
            assert c["logprob"] == entry[token_id] <= 0
            assert c["token"] == bytes(c["bytes"]).decode("utf-8", "replace")
            assert len(c["top_logprobs"]) == top_n
            ranked = [t["logprob"] for t in c["top_logprobs"]]
            assert ranked == sorted(ranked, reverse=True)
            assert all(set(t) == {"token", "logprob", "bytes"} for t in c["top_logprobs"])
        if top_n:  # greedy: the sampled token is the most likely one
            assert all(c["top_logprobs"][0]["token"] == c["token"] for c in content)
    assert rows[2]["response"]["body"]["choices"][0]["logprobs"] is None, "not asked for: null"

    done = export(client, [
        line("c3", "/v1/completions", {"prompt": "Once upon", "max_tokens": 5, "logprobs": 3,
                                       "ignore_eos": True}),
    ], tmp_path, "completions")
    job = client.get(done[0]["response"]["request_id"])
    lp = done[0]["response"]["body"]["choices"][0]["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    n = len(job.result.token_ids)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n
    assert lp["text_offset"][0] == 0
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(n)]
    for token, top, value in zip(lp["tokens"], lp["top_logprobs"], lp["token_logprobs"], strict=True):
        assert 3 <= len(top) <= 4 and token in top and max(top.values()) >= value  # top 3 + the sampled
