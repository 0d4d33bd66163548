"""/v1/chat/completions and /v1/completions through the openai SDK, plain and streamed, and GET /v1/jobs."""

from __future__ import annotations

import openai
import pytest

from tests.support.gateway_harness import MODEL

MESSAGES = [{"role": "user", "content": "Name three colours."}]


def test_chat_completion_equals_the_same_job_submitted_directly(gateway_stack):
    client = gateway_stack.openai("alice")
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=8,
                                                           temperature=0)
    job_id = raw.headers["x-tokenbus-job-id"]
    reply = raw.parse()
    assert reply.id == f"chatcmpl-{job_id}" and reply.object == "chat.completion" and reply.model == MODEL
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens <= 8 and reply.usage.total_tokens == (
        reply.usage.prompt_tokens + reply.usage.completion_tokens)
    with gateway_stack.producer() as producer:  # the same request straight onto the queue
        assert producer.get(job_id).priority == "interactive", "someone waits on it: ahead of default and bulk"
        direct = producer.wait(producer.submit(messages=MESSAGES, max_tokens=8, temperature=0.0, model=MODEL),
                               timeout=120)
    assert direct.result.text == choice.message.content

    with gateway_stack.http("alice") as http:
        polled = http.get(f"/v1/jobs/{job_id}").json()
    assert polled["status"] == "finished" and polled["response"] == reply.model_dump(exclude_unset=True)
    with gateway_stack.http("bob") as http:
        assert http.get(f"/v1/jobs/{job_id}").status_code == 404


def test_chat_completion_streams_server_sent_events(gateway_stack):
    client = gateway_stack.openai("alice")
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 2, "tokens came one by one"
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [plain.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].object == "chat.completion.chunk"


def test_completions_plain_and_streamed(gateway_stack):
    client = gateway_stack.openai("bob")
    plain = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6,
                                      temperature=0)
    assert plain.object == "text_completion" and plain.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0, stream=True))
    assert streamed == plain.choices[0].text


def test_bad_requests_name_the_field(gateway_stack):
    client = gateway_stack.openai("alice")
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=-1)
    assert err.value.param == "temperature" and "greater than or equal to 0" in err.value.message
    with pytest.raises(openai.BadRequestError, match="unknown field.*tools"):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[{"type": "function", "function": {
            "name": "f", "parameters": {}}}])
    with pytest.raises(openai.NotFoundError) as err:  # the worker serves another model
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=2)
    assert err.value.code == "model_not_found" and "gpt-4o" in err.value.message
    with pytest.raises(openai.APIError, match="gpt-4o"):  # streamed: the error arrives as an event
        list(client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=2, stream=True))
    with gateway_stack.http("alice") as http:
        resp = http.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert resp.status_code == 400 and set(resp.json()["error"]) == {"message", "type", "param", "code"}
