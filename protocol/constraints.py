"""Structured-output constraints of a job: `response_format`, `regex` and `choice`, as llguidance grammars.

Imports no torch: the producer checks a constraint at submit (the schema or regex must compile), the worker
checks it again on intake, and the engine compiles the same grammar text against its tokenizer
(worker/engine/guided.py). At most one constraint per job.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from llguidance import LLMatcher

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
JSON_SCHEMA_KEYS = {"name", "description", "schema", "strict"}
# {"type": "object"} in llguidance's JSON compiler: any JSON object (OpenAI's JSON mode)
ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}
JSON_DEFAULTS: dict[str, Any] = {"whitespace_flexible": False}


def check_response_format(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """ValueError unless value is OpenAI's {"type": "text" | "json_object"} or
    {"type": "json_schema", "json_schema": {"name"?, "description"?, "schema", "strict"?}}."""
    if value is None:
        return None
    kind = value.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise ValueError(f"response_format.type must be one of {list(RESPONSE_FORMAT_TYPES)} (got {kind!r})")
    extra = sorted(set(value) - ({"type", "json_schema"} if kind == "json_schema" else {"type"}))
    if extra:
        raise ValueError(f"response_format of type {kind!r} has unknown key(s) {extra}")
    if kind != "json_schema":
        return value
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise ValueError('response_format of type "json_schema" needs "json_schema": {"name": ..., "schema": {...}}')
    extra = sorted(set(spec) - JSON_SCHEMA_KEYS)
    if extra:
        raise ValueError(f"response_format.json_schema has unknown key(s) {extra} (known: {sorted(JSON_SCHEMA_KEYS)})")
    if not isinstance(spec.get("schema"), dict):
        raise ValueError("response_format.json_schema.schema must be a JSON Schema object")
    for key in ("name", "description"):
        if key in spec and not isinstance(spec[key], str):
            raise ValueError(f"response_format.json_schema.{key} must be a string")
    if "strict" in spec and not isinstance(spec["strict"], bool | None):
        raise ValueError("response_format.json_schema.strict must be a boolean")
    return value


def check_choice(value: list[str] | None) -> list[str] | None:
    if value is None:
        return None
    if not value:
        raise ValueError("choice must list at least one string")
    if any(s == "" for s in value):
        raise ValueError("choice strings must not be empty")
    return value


def grammar_for(response_format: dict[str, Any] | None, regex: str | None, choice: list[str] | None) -> str | None:
    """The llguidance grammar text of a job's one constraint; None when it has none. ValueError when it names
    more than one."""
    given = [name for name, v in (("response_format", _schema_of(response_format)), ("regex", regex),
                                  ("choice", choice)) if v is not None]
    if len(given) > 1:
        raise ValueError(f"give at most one constraint of response_format (json), regex, choice (got {given})")
    schema = _schema_of(response_format)
    if schema is not None:
        # compact JSON (", " and ": " only) unless the schema's "x-guidance" asks otherwise: a small model
        # left free whitespace can spend its max_tokens on newlines
        return LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_DEFAULTS)
    if regex is not None:
        return LLMatcher.grammar_from_regex(regex)
    if choice is not None:
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choice))
    return None


def grammar_error(grammar: str) -> str:
    """Why llguidance cannot compile the grammar (no tokenizer needed), or "" when it can."""
    return _grammar_error(grammar)


@lru_cache(maxsize=256)
def _grammar_error(grammar: str) -> str:
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    return messages[0] if is_error else ""


def _schema_of(response_format: dict[str, Any] | None) -> dict[str, Any] | None:
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "json_object":
        return ANY_JSON_OBJECT
    if kind == "json_schema":
        return response_format["json_schema"]["schema"]
    return None
