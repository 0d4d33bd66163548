"""Structured-output fields on the producer side (no engine): response_format / regex / choice are checked at
submit (the schema and regex must compile, at most one constraint), a refused job writes nothing, and the
CLI and OpenAI Batch lines carry them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from producer import Client, InvalidJob
from producer.cli import build_parser
from producer.openai_batch import CHAT, body_request
from protocol import scripts
from protocol.models import parse_request, validate_request

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}


@pytest.fixture
def client(redis_server):
    with Client(redis_server.url) as c:
        yield c


@pytest.mark.parametrize("fields", [
    {"response_format": {"type": "json_object"}},
    {"response_format": JSON_SCHEMA},
    {"response_format": {"type": "text"}},
    {"regex": r"[0-9]{3}-[0-9]{4}"},
    {"choice": ["yes", "no", "maybe"]},
])
def test_constraints_are_accepted_and_round_trip(fields):
    req = validate_request({"prompt": "x"} | fields)
    again = parse_request(req.to_json())  # what the worker reads back
    assert again.response_format == fields.get("response_format")
    assert again.regex == fields.get("regex") and again.choice == fields.get("choice")
    has_grammar = fields.get("response_format", {}).get("type") != "text"
    assert (again.constraint_grammar() is not None) == has_grammar


@pytest.mark.parametrize("fields, expect", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "foo"}}}},
     "response_format JSON schema cannot be compiled: Invalid type: foo"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"$ref": "#/nope"}}}},
     "cannot be compiled"),
    ({"response_format": {"type": "json_schema"}}, 'needs "json_schema"'),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "must be a JSON Schema object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "bogus": 1}}}, "unknown key"),
    ({"response_format": {"type": "xml"}}, "response_format.type must be one of"),
    ({"regex": "["}, "the regex cannot be compiled"),
    ({"regex": "(?<=a)b"}, "look-around"),
    ({"choice": []}, "at least one string"),
    ({"choice": ["a", ""]}, "must not be empty"),
    ({"regex": "a", "choice": ["a"]}, "at most one constraint"),
    ({"response_format": {"type": "json_object"}, "regex": "a"}, "at most one constraint"),
    ({"response_format": {"type": "json_object"}, "min_tokens": 4}, "min_tokens and ignore_eos"),
    ({"choice": ["a"], "ignore_eos": True}, "min_tokens and ignore_eos"),
])
def test_bad_constraints_are_refused_at_submit_and_nothing_is_written(client, fields, expect):
    with pytest.raises(InvalidJob, match="invalid job") as err:
        client.submit("hello", **fields)
    assert expect in str(err.value)
    assert scripts.queue_depth(client.redis, client.keys) == 0
    assert not client.redis.keys(f"{client.keys.prefix}:job:*")


def test_openai_batch_line_and_gateway_body_carry_response_format():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "response_format": JSON_SCHEMA}
    assert body_request(CHAT, body).response_format == JSON_SCHEMA
    with pytest.raises(InvalidJob, match=r"body: .*regex cannot be compiled"):
        body_request(CHAT, {"messages": [{"role": "user", "content": "hi"}], "regex": "("})


def test_cli_flags_build_the_constraint():
    p = build_parser()
    a = p.parse_args(["submit", "hi", "--response-format", json.dumps(JSON_SCHEMA)])
    assert a.response_format == JSON_SCHEMA
    a = p.parse_args(["submit", "hi", "--choice", "yes", "--choice", "no"])
    assert a.choice == ["yes", "no"]
    a = p.parse_args(["submit", "hi", "--regex", "[a-z]+"])
    assert a.regex == "[a-z]+"


def test_constraint_checks_import_no_torch():
    code = ("import sys; from protocol.models import validate_request; "
            "validate_request({'prompt': 'x', 'regex': '[a-z]+'}); assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
