"""Embedding jobs through Redis and a real in-process worker: the real all-MiniLM-L6-v2's vectors equal
SentenceTransformer.encode after the queue (float32 bytes and float16), one vector per input in order with
usage.prompt_tokens; bad inputs fail that job alone with a clear code; a generation on an encoder is
unsupported_kind; one tiny decoder serves both kinds in one worker; the vectors are compact in Redis."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from protocol.errors import InvalidJob
from protocol.keys import Keys
from protocol.registry import ModelRecord
from testbed.tiny_embedders import make_tiny_decoder
from worker.engine import loader

K = Keys("tokenbus")
ROOT = str(Path(__file__).resolve().parents[2])
TEXTS = ["A man is eating food.", "tokenbus embeds through the same queue", "short", "x " * 300]


@pytest.fixture(scope="module")
def minilm():
    from worker import Engine

    return Engine("all-minilm-l6-v2", device="cpu", dtype="float32", block_size=16, max_num_seqs=8,
                  max_num_batched_tokens=128, num_kv_blocks=64)


def st_encode(directory: str, texts: list[str]) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(directory, device="cpu").encode(texts, convert_to_numpy=True)


def test_minilm_vectors_through_the_queue_equal_sentence_transformers(minilm, serve, make_client, redis_server):
    client = make_client()
    handle = serve(minilm)
    want = st_encode(loader.resolve("all-minilm-l6-v2").directory, TEXTS)
    # the last text is past the 256-token context: refused without truncate, cut with it (as ST cuts it)
    jid = client.submit_embedding(TEXTS, truncate=True)
    half = client.submit_embedding(TEXTS[:2], embedding_dtype="float16", dimensions=128)
    ids_input = client.submit_embedding([minilm.tokenizer.encode(TEXTS[0])])
    too_long = client.submit_embedding(TEXTS[3])
    bad_ids = client.submit_embedding([[101, 10**6, 102]])
    generate = client.submit("an encoder cannot generate")
    jobs = {j.id: j for j in client.as_completed([jid, half, ids_input, too_long, bad_ids, generate], timeout=120)}

    job = jobs[jid]
    assert job.status == "finished", job.error
    got = np.array(client.vectors(job))
    assert got.shape == (4, 384) and job.result.embeddings == 4 and job.result.embedding_dtype == "float32"
    assert np.abs(got - want).max() <= 1e-5
    assert job.result.usage.prompt_tokens == sum(min(len(minilm.tokenizer.encode(t)), 256) for t in TEXTS)
    raw = redis_server.client().get(K.vectors(jid))
    assert len(raw) == 4 * 384 * 4  # raw float32, not JSON text
    assert redis_server.client().ttl(K.vectors(jid)) > 0  # expires with its record

    h = np.array(client.vectors(jobs[half]))
    cut = want[:2, :128] / np.linalg.norm(want[:2, :128], axis=1, keepdims=True)
    assert h.shape == (2, 128) and np.abs(h - cut).max() < 2e-3  # float16's precision
    assert len(redis_server.client().get(K.vectors(half))) == 2 * 128 * 2
    assert np.abs(np.array(client.vectors(jobs[ids_input]))[0] - want[0]).max() <= 1e-5

    assert jobs[too_long].status == "failed" and jobs[too_long].error_code == "invalid_request"
    assert "truncate" in jobs[too_long].error
    assert jobs[bad_ids].status == "failed" and "vocabulary" in jobs[bad_ids].error
    assert jobs[generate].status == "failed" and jobs[generate].error_code == "unsupported_kind"

    record = ModelRecord.from_json(redis_server.client().hget(K.models, "all-minilm-l6-v2"))
    assert record.kind == "embed" and record.served_kinds() == ["embed"]
    assert handle.stop() == 0


def test_bad_inputs_are_refused_at_submit(make_client):
    client = make_client()
    for bad, what in (("", "empty string"), ([], "empty list"), (["a"] * 2049, "at most 2048"),
                      (["a", [1, 2]], "mixes"), ([[1, -1]], ">= 0")):
        with pytest.raises(InvalidJob, match=what):
            client.submit_embedding(bad)
    with pytest.raises(InvalidJob, match="no generation fields: max_tokens"):
        client.submit_embedding("a", max_tokens=3)
    with pytest.raises(InvalidJob, match="embedding jobs"):
        client.submit("a", dimensions=3)


def test_one_decoder_serves_both_kinds(tmp_path, serve, make_client):
    from worker import Engine

    directory = make_tiny_decoder(str(tmp_path / "qwen3"))
    engine = Engine(directory, device="cpu", dtype="float32", block_size=8, max_num_seqs=4,
                    max_num_batched_tokens=32, num_kv_blocks=32)
    client = make_client()
    handle = serve(engine)
    gen = client.submit("hello there", max_tokens=4, temperature=0)
    emb = client.submit_embedding(["hello there", "a second input"])
    jobs = {j.id: j for j in client.as_completed([gen, emb], timeout=120)}
    assert jobs[gen].status == "finished" and len(jobs[gen].result.token_ids) == 4
    assert jobs[emb].status == "finished", jobs[emb].error
    want = st_encode(directory, ["hello there", "a second input"])
    cos = [float(np.dot(a, b) / np.linalg.norm(a) / np.linalg.norm(b)) for a, b in
           zip(np.array(client.vectors(jobs[emb])), want, strict=True)]
    assert min(cos) >= 0.99999
    assert sorted(client.info().models[0].kinds) == ["embed", "generate"]
    assert handle.stop() == 0


def cli(url: str, *args: str) -> str:
    """`tokenbus ...` as its own process (its main() configures structlog for the whole process)."""
    out = subprocess.run([sys.executable, "-m", "producer", "--url", url, *args], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_batch_export_in_openai_format_then_drop_vectors(minilm, serve, make_client, redis_server, tmp_path):

    client = make_client()
    handle = serve(minilm)
    lines = [json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/embeddings",
                         "body": {"input": [f"text {i}", f"more {i}"], "encoding_format": "float"}})
             for i in range(5)]
    lines.append(json.dumps({"custom_id": "bad", "method": "POST", "url": "/v1/embeddings",
                             "body": {"input": ["fine", "word " * 300]}}))  # too long: this line alone fails
    record = client.submit_batch(lines)
    from producer.batches import wait_batch

    wait_batch(client, record.id, timeout=120)
    r = redis_server.client()
    ids = [f"{record.id}-{i}" for i in range(6)]
    assert sum(r.exists(K.vectors(j)) for j in ids) == 5
    stored = sum(r.memory_usage(K.vectors(j)) for j in ids[:5])
    # 3,072 bytes of vectors a job: the string's allocation rounds to 3,584, plus the key (docs/embeddings.md)
    assert stored < 5 * (2 * 384 * 4 + 1024)
    out = tmp_path / "out.jsonl"
    cli(redis_server.url, "batch", "export", record.id, str(out), "--drop-vectors")
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [row["custom_id"] for row in rows] == [*(f"c{i}" for i in range(5)), "bad"]
    body = rows[0]["response"]["body"]
    assert body["object"] == "list" and [d["index"] for d in body["data"]] == [0, 1]
    assert len(body["data"][0]["embedding"]) == 384 and body["usage"]["prompt_tokens"] > 0
    assert rows[5]["response"] is None and rows[5]["error"]["code"] == "invalid_request"
    assert sum(r.exists(K.vectors(j)) for j in ids) == 0  # dropped once exported; the records stay
    assert all(r.exists(K.job(j)) for j in ids)

    answer = json.loads(cli(redis_server.url, "embed", "hello", "world", "--dimensions", "8"))
    assert [len(d["embedding"]) for d in answer["data"]] == [8, 8] and answer["model"] == "all-minilm-l6-v2"
    assert handle.stop() == 0
