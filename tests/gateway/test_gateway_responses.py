"""/v1/responses through the official Python SDK against the real stack (a worker on SmolLM2-135M): plain,
streamed with the Responses event types, a json_schema format whose output validates, what is not served
refused naming the field, and a /v1/responses batch whose lines share a system prompt reporting
cached_tokens > 0 from the worker's prefix cache."""

from __future__ import annotations

import json
import uuid

import jsonschema
import openai
import pytest

from tests.support.gateway_harness import MODEL, write_jsonl

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def test_responses_plain_and_streamed(gateway_stack):
    client = gateway_stack.openai("alice")
    ask = {"model": MODEL, "input": "Name three colours.", "instructions": "Be brief.", "max_output_tokens": 8,
           "temperature": 0}
    plain = client.responses.create(**ask)
    assert plain.object == "response" and plain.id.startswith("resp_") and plain.model == MODEL
    assert plain.output_text and plain.status in ("completed", "incomplete")
    assert plain.usage.output_tokens <= 8 and plain.usage.total_tokens == (
        plain.usage.input_tokens + plain.usage.output_tokens)
    events = list(client.responses.create(**ask, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete") and "response.output_text.done" in kinds
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == plain.output_text and len(deltas) >= 2, "tokens came one by one"
    assert events[-1].response.output_text == plain.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_responses_json_schema_output_validates(gateway_stack):
    client = gateway_stack.openai("alice")
    reply = client.responses.create(
        model=MODEL, input=[{"role": "user", "content": [{"type": "input_text", "text": "Describe a person."}]}],
        max_output_tokens=60, temperature=0,
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}})
    jsonschema.validate(json.loads(reply.output_text), PERSON)
    assert reply.text.format.type == "json_schema"


def test_responses_refuse_what_is_not_served_naming_the_field(gateway_stack):
    client = gateway_stack.openai("alice")
    for extra, param in (({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
                         ({"reasoning": {"effort": "low"}}, "reasoning"),
                         ({"previous_response_id": "resp_x"}, "previous_response_id")):
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.create(model=MODEL, input="hi", **extra)
        assert err.value.code == "unsupported_parameter" and err.value.param == param, err.value.body
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "https://example.com/a.png"}]}])
    assert err.value.code == "unsupported_parameter" and err.value.param == "input.0.content.0"


def test_a_responses_batch_with_a_shared_system_prompt_reports_cached_tokens(gateway_stack, tmp_path):
    client = gateway_stack.openai("bob")  # not carol: test_gateway_batches counts carol's batches
    system = f"Session {uuid.uuid4().hex}. " + "You answer questions about colours in one short word. " * 12
    lines = [json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/responses",
                         "body": {"model": MODEL, "instructions": system, "input": f"Colour number {i}?",
                                  "max_output_tokens": 3, "temperature": 0}}) for i in range(6)]
    fid = client.files.create(file=write_jsonl(tmp_path / "in.jsonl", lines).open("rb"), purpose="batch").id
    batch = client.batches.create(input_file_id=fid, endpoint="/v1/responses", completion_window="24h")
    done = gateway_stack.wait_batch(client, batch.id)
    assert done.status == "completed" and done.request_counts.completed == 6
    out = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    bodies = [x["response"]["body"] for x in out]
    assert all(b["object"] == "response" and b["output"][0]["content"][0]["text"] for b in bodies)
    assert done.usage.input_tokens == sum(b["usage"]["input_tokens"] for b in bodies)
    assert done.usage.output_tokens == sum(b["usage"]["output_tokens"] for b in bodies)
    cached = sum(b["usage"]["input_tokens_details"]["cached_tokens"] for b in bodies)
    assert done.usage.input_tokens_details.cached_tokens == cached > 0, "the shared prompt came from the cache"
    assert done.model == MODEL
