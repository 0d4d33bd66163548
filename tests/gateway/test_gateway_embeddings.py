"""/v1/embeddings through the official openai SDK against a real gateway and a real worker on all-MiniLM-L6-v2:
client.embeddings.create (float, and base64, which the SDK asks for and decodes by default) equals
SentenceTransformer.encode; a /v1/embeddings batch round trip (files.create, batches.create, files.content) in
OpenAI's output format, where a bad line fails alone; the model lists its kind."""

from __future__ import annotations

import base64
import json

import numpy as np
import openai
import pytest

from tests.support.gateway_harness import EMBED_MODEL, write_jsonl
from worker.engine import loader

TEXTS = ["The cat sits outside", "A man is playing guitar", "tokenbus"]


@pytest.fixture(scope="module")
def want() -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(loader.resolve(EMBED_MODEL).directory, device="cpu")
    return st.encode(TEXTS, convert_to_numpy=True)


def test_embeddings_create_float_and_base64(embed_gateway_stack, want):
    client = embed_gateway_stack.openai("alice")
    # the SDK's default asks for base64 and decodes it; an explicit base64 hands back the strings
    for fmt in (openai.NOT_GIVEN, "float", "base64"):
        out = client.embeddings.create(model=EMBED_MODEL, input=TEXTS, encoding_format=fmt)
        got = np.array([np.frombuffer(base64.b64decode(d.embedding), "<f4") if fmt == "base64" else d.embedding
                        for d in out.data], dtype=np.float32)
        assert got.shape == (3, 384) and [d.index for d in out.data] == [0, 1, 2]
        assert np.abs(got - want).max() <= 1e-5, fmt
        assert out.usage.prompt_tokens == out.usage.total_tokens > 0 and out.model == EMBED_MODEL
    one = client.embeddings.create(model=EMBED_MODEL, input=TEXTS[0], dimensions=64)
    assert len(one.data) == 1 and len(one.data[0].embedding) == 64
    with pytest.raises(openai.BadRequestError, match="empty string"):
        client.embeddings.create(model=EMBED_MODEL, input="")
    with pytest.raises(openai.BadRequestError, match="truncate"):
        client.embeddings.create(model=EMBED_MODEL, input="word " * 400)
    models = {m.id: m for m in client.models.list().data}
    assert models[EMBED_MODEL].model_extra["kinds"] == ["embed"]


def line(custom_id: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings", "body": body})


def test_embeddings_batch_round_trip(embed_gateway_stack, tmp_path, want):
    client = embed_gateway_stack.openai("alice")
    src = write_jsonl(tmp_path / "emb.jsonl", [
        line("a", {"model": EMBED_MODEL, "input": TEXTS}),
        line("b", {"model": EMBED_MODEL, "input": TEXTS[1], "encoding_format": "base64"}),
        line("bad", {"model": EMBED_MODEL, "input": [[101, 999999, 102]]}),  # outside the vocabulary: this line
    ])
    uploaded = client.files.create(file=src.open("rb"), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")
    done = embed_gateway_stack.wait_batch(client, batch.id, timeout=240)
    assert done.status == "completed" and (done.request_counts.completed, done.request_counts.failed) == (2, 1)
    out = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    assert [o["custom_id"] for o in out] == ["a", "b"]
    body = out[0]["response"]["body"]
    assert out[0]["response"]["status_code"] == 200 and body["object"] == "list"
    got = np.array([d["embedding"] for d in body["data"]], dtype=np.float32)
    assert np.abs(got - want).max() <= 1e-5
    b64 = out[1]["response"]["body"]["data"][0]["embedding"]
    assert isinstance(b64, str) and np.abs(np.frombuffer(base64.b64decode(b64), "<f4")
                                           - want[1]).max() <= 1e-5
    errors = [json.loads(x) for x in client.files.content(done.error_file_id).text.splitlines()]
    assert [e["custom_id"] for e in errors] == ["bad"] and "vocabulary" in json.dumps(errors)
