"""OpenAI's Responses API (/v1/responses) <-> tokenbus jobs: a request body -> JobRequest fields, a finished job
-> the `response` object. The batch line mapping of producer/openai_batch.py dispatches here for
/v1/responses lines, so the gateway's POST /v1/responses, a gateway batch and `tokenbus batch submit` map a
body the same way (docs/protocol.md, "The /v1/responses mapping").

What a job cannot do (tools, reasoning, stored conversations, images and files) is refused naming the field
(UnsupportedParameter), never silently dropped: a client must learn that its tool was not offered.
"""

from __future__ import annotations

import json
from typing import Any

from protocol.errors import InvalidJob
from protocol.models import Job

RESPONSES = "/v1/responses"

# accepted, no effect on generation (tokenbus stores no responses: `store` changes nothing)
_IGNORED = {"user", "store", "service_tier", "truncation", "background", "safety_identifier", "prompt_cache_key"}
_SERVED = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "text", "metadata",
           "stream", "seed", "stop"} | _IGNORED
# refused by name: tokenbus runs no tools, no reasoning models' effort control, keeps no stored responses
UNSUPPORTED = ("tools", "tool_choice", "parallel_tool_calls", "reasoning", "previous_response_id", "conversation",
               "include", "prompt", "top_logprobs", "max_tool_calls")
_TEXT_PARTS = {"input_text", "output_text", "text"}


class UnsupportedParameter(InvalidJob):
    """A Responses field (or input item) that exists in OpenAI's API but that tokenbus does not serve."""

    def __init__(self, param: str, why: str) -> None:
        super().__init__(f"{param}: {why}")
        self.param = param


def responses_fields(body: dict[str, Any]) -> dict[str, Any]:
    """A /v1/responses body -> JobRequest fields (the caller validates them). Raises InvalidJob naming the field,
    UnsupportedParameter for what exists in OpenAI's API but is not served here."""
    for name in UNSUPPORTED:
        if name in body and body[name] not in (None, [], False) and not (name == "tool_choice"
                                                                          and body[name] == "none"):
            raise UnsupportedParameter(f"body.{name}", f"{name} is not supported by tokenbus (no tools, reasoning "
                                       "controls or stored responses); leave it out")
    unknown = sorted(set(body) - _SERVED - set(UNSUPPORTED))
    if unknown:
        raise InvalidJob(f"body: unknown field(s) {', '.join(unknown)} for {RESPONSES} "
                         f"(supported: {', '.join(sorted(_SERVED))})")
    if body.get("stream", False) is not False:
        raise InvalidJob("body.stream: streaming is not available in a batch; leave it out or set false")
    fields: dict[str, Any] = {k: body[k] for k in ("model", "temperature", "top_p", "seed", "stop", "metadata")
                              if body.get(k) is not None}
    if body.get("max_output_tokens") is not None:
        fields["max_tokens"] = body["max_output_tokens"]
    if (fmt := _text_format(body.get("text"))) is not None:
        fields["response_format"] = fmt
    messages = [] if body.get("instructions") is None else [{"role": "system", "content": body["instructions"]}]
    if "input" not in body:
        raise InvalidJob(f"body.input: required for {RESPONSES} (a string, or a list of message items)")
    fields["messages"] = messages + _input_messages(body["input"])
    return fields


def _text_format(text: Any) -> dict[str, Any] | None:
    """text.format -> the structured-output path's response_format (protocol/constraints.py)."""
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise InvalidJob('body.text: an object with "format", e.g. {"format": {"type": "json_object"}}')
    fmt = text.get("format")
    if fmt is None or fmt == {"type": "text"}:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise InvalidJob("body.text.format.schema: a json_schema format needs its JSON schema object")
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise InvalidJob(f"body.text.format.type: one of text, json_object, json_schema (got {json.dumps(fmt)[:80]})")


def _input_messages(value: Any) -> list[Any]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise InvalidJob("body.input: a string, or a non-empty list of message items")
    return [_item(i, item) for i, item in enumerate(value)]


def _item(i: int, item: Any) -> Any:
    where = f"body.input.{i}"
    if not isinstance(item, dict):
        raise InvalidJob(f"{where}: a message item {{\"role\", \"content\"}} (got {type(item).__name__})")
    kind = item.get("type", "message")
    if kind != "message":
        raise UnsupportedParameter(f"{where}.type", f"input items of type {kind!r} are not supported; only "
                                   "message items (role and content)")
    role = "system" if item.get("role") == "developer" else item.get("role")
    content = item.get("content")
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            ptype = part.get("type") if isinstance(part, dict) else None
            if ptype not in _TEXT_PARTS:
                raise UnsupportedParameter(f"{where}.content.{j}", f"only text parts are supported (got "
                                           f"{ptype or type(part).__name__!r}: no images, files or audio)")
            if not isinstance(part.get("text"), str):
                raise InvalidJob(f"{where}.content.{j}.text: a string")
            texts.append(part["text"])
        content = "".join(texts)
    out = {"role": role, "content": content}
    extra = set(item) - {"type", "role", "content", "id", "status"}
    if extra:
        raise InvalidJob(f"{where}: unknown field(s) {', '.join(sorted(extra))} of a message item")
    return out


def response_object(job: Job) -> dict[str, Any]:
    """A finished job as OpenAI's `response` object (what POST /v1/responses answers, the body of a batch's
    /v1/responses output line)."""
    result = job.result
    assert result is not None
    request = job.request or {}
    text = result.text
    incomplete = result.finish_reason == "length"
    message = {"type": "message", "id": f"msg_{job.id}", "status": "incomplete" if incomplete else "completed",
               "role": "assistant", "content": [{"type": "output_text", "text": text, "annotations": [],
                                                 "logprobs": []}]}
    fmt = request.get("response_format")
    text_format: dict[str, Any] = {"type": "text"}
    if fmt and fmt.get("type") == "json_schema":
        text_format = {"type": "json_schema", **fmt.get("json_schema", {})}
    elif fmt:
        text_format = {"type": fmt["type"]}
    messages = request.get("messages") or []
    instructions = messages[0]["content"] if messages and messages[0].get("role") == "system" else None
    return {
        "id": f"resp_{job.id}", "object": "response", "created_at": int(job.created_at or 0),
        "status": "incomplete" if incomplete else "completed", "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": instructions, "max_output_tokens": request.get("max_tokens"),
        "model": result.model or request.get("model") or "unknown", "output": [message],
        "parallel_tool_calls": False, "previous_response_id": None, "reasoning": None,
        "temperature": request.get("temperature", 1.0), "top_p": request.get("top_p", 1.0),
        "text": {"format": text_format}, "tool_choice": "none", "tools": [], "truncation": "disabled",
        "metadata": request.get("metadata") or {}, "usage": responses_usage(result.usage), "store": False,
    }


def responses_usage(usage: Any) -> dict[str, Any]:
    """A job's Usage in the Responses shape."""
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.total_tokens}
