"""GET /v1/models and model_not_found through the official openai SDK: real Redis, worker (SmolLM2-135M), HTTP."""

from __future__ import annotations

import openai
import pytest

from protocol.keys import Keys
from tests.support.gateway_harness import MODEL, chat_line, write_jsonl

K = Keys("tokenbus")


def test_the_sdk_lists_the_models_and_gets_404_model_not_found_for_an_unknown_one(gateway_stack, tmp_path):
    client = gateway_stack.openai("alice")
    listed = {m.id: m for m in client.models.list()}
    assert MODEL in listed
    served = listed[MODEL]
    assert served.object == "model" and served.owned_by == "tokenbus" and served.created > 0
    assert served.model_extra["workers"] >= 1 and served.model_extra["kind"] == "generate"
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("no-such-model")
    assert err.value.code == "model_not_found"

    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    assert err.value.code == "model_not_found" and err.value.param == "model" and MODEL in err.value.message
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    assert err.value.code == "model_not_found"

    src = write_jsonl(tmp_path / "in.jsonl", [chat_line("ok", "Hi"), chat_line("bad", "Hi", model="no-such-model")])
    uploaded = client.files.create(file=src.open("rb"), purpose="batch")
    with pytest.raises(openai.NotFoundError) as err:
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert err.value.code == "model_not_found" and "no-such-model" in err.value.message
    assert client.batches.list().data == [] or all(b.input_file_id != uploaded.id for b in client.batches.list())
