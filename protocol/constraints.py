"""Structured-output constraints of a job: `response_format`, `regex` and `choice`, as llguidance grammars.

Imports no torch: the producer checks a constraint at submit (the schema or regex must compile), the worker
checks it again on intake, and the engine compiles the same grammar text against its tokenizer
(worker/engine/guided.py). At most one constraint per job.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llguidance import LLParserLimits

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
JSON_SCHEMA_KEYS = {"name", "description", "schema", "strict"}
# {"type": "object"} in llguidance's JSON compiler: any JSON object (OpenAI's JSON mode)
ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}
JSON_DEFAULTS: dict[str, Any] = {"whitespace_flexible": False}


@dataclass(frozen=True)
class ConstraintLimits:
    """What one constraint may cost: the one definition, read by the submit check (here) and the engine
    (worker/engine/guided.py), so a job accepted at submit never fails in the engine on a limit."""

    # llguidance's Earley parser keeps one item per choice (+1) in a row once the choices share a prefix,
    # and fails a row over max_items_in_row (2000): 2,000 "item N" choices failed after their first token.
    max_choice_count: int = 1000
    max_choice_bytes: int = 64 * 1024  # all choice strings together (UTF-8)
    max_regex_bytes: int = 8 * 1024
    # a{100000} costs ~25-80 ms of CPU per mask, every step (a{1000}: 0.2 ms); nested counts multiply
    max_repeat: int = 1000
    max_schema_bytes: int = 64 * 1024  # the JSON schema, compact JSON
    max_schema_depth: int = 32  # nested objects and arrays of the schema document
    # the parser's own limits, passed to llguidance at submit and in the engine alike
    max_items_in_row: int = 2000
    step_max_items: int = 50_000
    step_lexer_fuel: int = 200_000
    # the engine fails a sequence whose one mask took more CPU than this (code grammar_too_costly): a step
    # waits for every row's mask, so one costly grammar would slow every request in the batch
    mask_budget_ms: float = 50.0

    def parser_limits(self) -> LLParserLimits:
        from llguidance import LLParserLimits  # llguidance loads with the first constraint, not with every process

        return LLParserLimits(max_items_in_row=self.max_items_in_row, step_max_items=self.step_max_items,
                              step_lexer_fuel=self.step_lexer_fuel, verbose_errors=False)


LIMITS = ConstraintLimits()


def _over(what: str, value: int, name: str, limit: int, advice: str) -> ValueError:
    return ValueError(f"{what} is {value}, over the limit {name} = {limit}; {advice}")


def check_regex(value: str | None, limits: ConstraintLimits = LIMITS, what: str = "regex") -> str | None:
    """ValueError when the regex is longer than max_regex_bytes or repeats more than max_repeat times."""
    if value is None:
        return None
    size = len(value.encode())
    if size > limits.max_regex_bytes:
        raise _over(f"the {what} length in bytes", size, "max_regex_bytes", limits.max_regex_bytes,
                    "use a shorter pattern")
    repeat = regex_repeat(value)
    if repeat > limits.max_repeat:
        raise _over(f"the {what}'s repetition count (nested counts multiplied)", repeat, "max_repeat",
                    limits.max_repeat, "use * or + instead of a large {n} or {n,m}, or ask for fewer repeats")
    return value


_QUANT = re.compile(r"\{\s*(\d*)\s*(?:,\s*(\d*)\s*)?\}")


def regex_repeat(regex: str) -> int:
    """The largest bounded repetition count of regex, nested counts multiplied: (a{10}){20} gives 200.
    Unbounded * and + cost nothing here (the lexer loops on one state)."""
    stack = [1]  # per open group: the largest factor inside it so far
    worst, atom, i = 1, 1, 0
    while i < len(regex):
        c = regex[i]
        if c == "\\":
            atom, i = 1, i + 2
        elif c == "[":  # a class is one atom: skip to its closing ] (a ] first in the class is literal)
            j = i + 1 + (regex[i + 1:i + 2] == "^")
            j += regex[j:j + 1] == "]"
            while j < len(regex) and regex[j] != "]":
                j += 2 if regex[j] == "\\" else 1
            atom, i = 1, j + 1
        elif c == "(":
            stack.append(1)
            atom, i = 1, i + 1
        elif c == ")" and len(stack) > 1:
            atom, i = stack.pop(), i + 1
        elif c == "{" and (m := _QUANT.match(regex, i)) and (m.group(1) or m.group(2)):
            count = max(int(m.group(1) or 0), int(m.group(2) or 0))
            atom *= max(count, 1)
            stack[-1] = max(stack[-1], atom)
            worst, i = max(worst, atom), m.end()
            continue
        else:
            atom, i = 1, i + 1
        stack[-1] = max(stack[-1], atom)
    return max(worst, *stack)


_SCHEMA_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")


def check_schema(schema: Any, limits: ConstraintLimits = LIMITS) -> None:
    """ValueError when a JSON schema is too big, too deep, or asks for too many repeats (maxLength,
    maxItems, ... and its patterns, checked as regexes)."""
    size = len(json.dumps(schema, separators=(",", ":")).encode())
    if size > limits.max_schema_bytes:
        raise _over("the JSON schema's size in bytes", size, "max_schema_bytes", limits.max_schema_bytes,
                    "simplify the schema")
    todo: list[tuple[Any, int]] = [(schema, 1)]
    while todo:
        node, depth = todo.pop()
        if depth > limits.max_schema_depth:
            raise _over("the JSON schema's nesting depth", depth, "max_schema_depth", limits.max_schema_depth,
                        "flatten the schema")
        if isinstance(node, dict):
            for key, value in node.items():
                if key in _SCHEMA_COUNTS and isinstance(value, int) and value > limits.max_repeat:
                    raise _over(f"the JSON schema's {key}", value, "max_repeat", limits.max_repeat,
                                f"leave {key} out or lower it")
                if key == "pattern" and isinstance(value, str):
                    check_regex(value, limits, what="JSON schema pattern")
                todo.append((value, depth + 1))
        elif isinstance(node, list):
            todo.extend((v, depth + 1) for v in node)


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
    check_schema(spec["schema"])
    return value


def check_choice(value: list[str] | None, limits: ConstraintLimits = LIMITS) -> list[str] | None:
    if value is None:
        return None
    if not value:
        raise ValueError("choice must list at least one string")
    if len(value) > limits.max_choice_count:
        raise _over("the number of choice strings", len(value), "max_choice_count", limits.max_choice_count,
                    "use a regex or a JSON schema enum for long lists")
    size = sum(len(s.encode()) for s in value)
    if size > limits.max_choice_bytes:
        raise _over("the choice strings' total size in bytes", size, "max_choice_bytes", limits.max_choice_bytes,
                    "send fewer or shorter choices")
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
    if not given:
        return None
    from llguidance import LLMatcher  # llguidance loads with the first constraint, not with every process

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
    from llguidance import LLMatcher  # llguidance loads with the first constraint, not with every process

    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, limits=LIMITS.parser_limits())
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
