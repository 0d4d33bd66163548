"""OpenAI Batch API lines <-> tokenbus jobs: input line -> JobRequest dict, job -> output line.

Served endpoints: SERVED (chat, completions, responses: producer/openai_responses.py maps them; embeddings: an
embedding job, protocol/embeddings.py, its output line's body OpenAI's embeddings response made from the job's
vectors, producer/vectors.py). OpenAI's other batch endpoints are named in KNOWN, so a batch of them is refused
as not served rather than unknown.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from producer.openai_responses import RESPONSES, response_object, responses_fields
from producer.vectors import embeddings_response
from protocol.errors import InvalidJob
from protocol.models import (
    GenerationParams,
    Job,
    JobRequest,
    JobResult,
    JobStatus,
    ResultChoice,
    describe_validation_error,
    validate_request,
)
from protocol.priority import Priority

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"
# The endpoints a batch line (and the gateway) serves: each has its body mapping in _MAPPINGS and its answer in
# response_body.
SERVED = (CHAT, COMPLETIONS, RESPONSES, EMBEDDINGS)
# OpenAI's batch endpoints (batches.create's list, 2026): accepted by name, refused as unsupported_endpoint
# unless served, so a client learns what is served instead of a bare validation error.
KNOWN = SERVED + ("/v1/moderations", "/v1/images/generations", "/v1/images/edits", "/v1/videos",
                  "/v1/audio/speech", "/v1/audio/transcriptions")

# Body fields passed through under the same name: every generation field (OpenAI's and the engine's extras,
# as vLLM accepts them) but logprobs, whose OpenAI meaning differs per endpoint (mapped below).
_SAME_NAME = (set(GenerationParams.model_fields) - {"logprobs"}) | {"model"}
_IGNORED = {"user"}  # accepted, no effect on generation
_CHAT_FIELDS = _SAME_NAME | _IGNORED | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "stream",
                                        "metadata"}
_COMPLETION_FIELDS = _SAME_NAME | _IGNORED | {"prompt", "logprobs", "stream", "echo", "best_of", "suffix"}
# OpenAI's embeddings body, plus tokenbus's truncate and embedding_dtype (how the vectors are kept in Redis)
_EMBED_FIELDS = {"input", "model", "encoding_format", "dimensions", "truncate", "embedding_dtype", "metadata"}


class InputLine(BaseModel):
    """One line of an OpenAI Batch input file."""

    model_config = ConfigDict(extra="forbid", strict=True)

    custom_id: str
    method: Literal["POST"]
    url: Literal["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings"]
    body: dict[str, Any]


_UNPARSED = object()
_URLS = SERVED


def parse_line(text: str, raw: Any = _UNPARSED, overrides: dict[str, Any] | None = None
               ) -> tuple[InputLine, JobRequest, str]:
    """One input line -> (the line, its JobRequest, validated, and that request's JSON). Raises InvalidJob with a
    readable reason. raw: the line's JSON when the caller has parsed it already (not parsed twice); overrides:
    request fields set after the body's mapping, before the one validation (submit_fields)."""
    try:
        if raw is _UNPARSED:
            raw = json.loads(text)
    except json.JSONDecodeError as err:
        raise InvalidJob(f"not valid JSON ({err.msg} at column {err.colno})") from None
    except RecursionError:
        raise InvalidJob("not a batch line: its JSON is nested too deeply") from None
    except ValueError as err:  # an integer past Python's digits limit
        raise InvalidJob(f"not a batch line: {err}") from None
    custom_id, url, request, request_json = batch_request(raw, overrides)
    line = InputLine.model_construct(custom_id=custom_id, method="POST", url=url, body=raw["body"])
    return line, request, request_json


def batch_request(raw: Any, overrides: dict[str, Any] | None = None) -> tuple[str, str, JobRequest, str]:
    """A batch line's parsed JSON -> (custom_id, url, its JobRequest, validated, and that request's JSON), or
    InvalidJob with a readable reason: what parse_line checks, without building an InputLine per line."""
    # The common line (exactly the four fields, of the types InputLine takes in strict mode) is checked here:
    # InputLine's own validation costs more than the request's mapping; any other line goes through it, for
    # its error (or, should this test be stricter than InputLine, for its verdict).
    if (type(raw) is dict and len(raw) == 4 and type(custom_id := raw.get("custom_id")) is str and custom_id
            and raw.get("method") == "POST" and (url := raw.get("url")) in _URLS
            and type(body := raw.get("body")) is dict):
        request, text_json = _body_request(url, body, overrides)
        return custom_id, url, request, text_json
    try:
        line = InputLine.model_validate(raw)
    except ValidationError as err:
        raise InvalidJob(describe_validation_error(err)) from None
    if not line.custom_id:
        raise InvalidJob("custom_id must not be empty")
    request, text_json = _body_request(line.url, line.body, overrides)
    return line.custom_id, line.url, request, text_json


def body_request(url: str, body: dict[str, Any]) -> JobRequest:
    """The JobRequest of one request body of `url`, as a batch line's body is mapped: the one validation of a
    request in the producer's process (the gateway's too); what follows only fills in fields (with_fields).
    Raises InvalidJob naming the field."""
    return _body_request(url, body, None)[0]


def _body_request(url: str, body: dict[str, Any], overrides: dict[str, Any] | None) -> tuple[JobRequest, str]:
    if not isinstance(body, dict):
        raise InvalidJob(f"body: a request body must be a JSON object, got {type(body).__name__}")
    fields = _MAPPINGS[url](body)
    if overrides:
        fields.update(overrides)
    try:
        request = validate_request(fields)
        text = request.to_json()  # the size limit, and text that is valid Unicode
    except InvalidJob as err:
        raise InvalidJob("body: " + str(err).removeprefix("invalid job: ")) from None
    return request, text


def submit_fields(model: str | None, priority: Priority) -> dict[str, Any]:
    """What a batch submit sets in every request (overrides of parse_line): its queue's priority; model: None
    keeps the line's, "" drops it (any worker model), else replaces it."""
    fields: dict[str, Any] = {"priority": Priority(priority)}
    if model is not None:
        fields["model"] = model or None
    return fields


def _check_known(body: dict[str, Any], allowed: set[str], url: str) -> None:
    if allowed.issuperset(body):
        return
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise InvalidJob(f"body: unknown field(s) {', '.join(unknown)} for {url} "
                         f"(supported: {', '.join(sorted(allowed))})")


def _common(body: dict[str, Any]) -> dict[str, Any]:
    if body.get("stream", False) is not False:
        raise InvalidJob("body.stream: streaming is not available in a batch; leave it out or set false")
    return {k: v for k, v in body.items() if k in _SAME_NAME}


def _chat_fields(body: dict[str, Any]) -> dict[str, Any]:
    _check_known(body, _CHAT_FIELDS, CHAT)
    fields = _common(body)
    if "max_completion_tokens" in body:
        if "max_tokens" in body:
            raise InvalidJob("body: give max_tokens or max_completion_tokens, not both")
        fields["max_tokens"] = body["max_completion_tokens"]
    top = body.get("top_logprobs")
    if body.get("logprobs"):
        fields["logprobs"] = 0 if top is None else top
    elif top is not None:
        raise InvalidJob("body.top_logprobs: needs logprobs: true")
    if body.get("metadata") is not None:
        fields["metadata"] = body["metadata"]
    if "messages" not in body:
        raise InvalidJob("body.messages: required for /v1/chat/completions")
    fields["messages"] = [_message(i, m) for i, m in enumerate(body["messages"] or [])] \
        if isinstance(body["messages"], list) else body["messages"]
    return fields


def _message(i: int, m: Any) -> Any:
    """Flatten OpenAI content parts ([{type: text, text}]) to a string; 'developer' is a system message."""
    if not isinstance(m, dict):
        return m
    m = dict(m)
    if m.get("role") == "developer":
        m["role"] = "system"
    content = m.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            is_text = isinstance(part, dict) and part.get("type") == "text"
            if not (is_text and isinstance(part.get("text"), str)):
                raise InvalidJob(f"body.messages.{i}.content: only text parts are supported "
                                 f"(got {json.dumps(part)[:60]})")
            texts.append(part["text"])
        m["content"] = "".join(texts)
    return m


def _embedding_fields(body: dict[str, Any]) -> dict[str, Any]:
    _check_known(body, _EMBED_FIELDS | _IGNORED, EMBEDDINGS)
    if "input" not in body:
        raise InvalidJob("body.input: required for /v1/embeddings")
    return {k: v for k, v in body.items() if k in _EMBED_FIELDS}


def _completion_fields(body: dict[str, Any]) -> dict[str, Any]:
    _check_known(body, _COMPLETION_FIELDS, COMPLETIONS)
    fields = _common(body)
    for name, ok in (("echo", False), ("best_of", 1), ("suffix", None)):
        if name in body and body[name] != ok:
            raise InvalidJob(f"body.{name}: only {json.dumps(ok)} is supported (got {body[name]!r})")
    if body.get("logprobs") is not None:
        fields["logprobs"] = body["logprobs"]
    if "prompt" not in body:
        raise InvalidJob("body.prompt: required for /v1/completions")
    prompt = body["prompt"]
    if isinstance(prompt, list) and prompt and all(isinstance(p, int) and not isinstance(p, bool)
                                                   for p in prompt):
        fields["prompt_token_ids"] = prompt
        return fields
    if isinstance(prompt, list):  # a list of prompts (or of token lists) is n jobs in one line: not here
        if len(prompt) != 1:
            raise InvalidJob(f"body.prompt: one prompt per line (got a list of {len(prompt)})")
        prompt = prompt[0]
        if isinstance(prompt, list):
            fields["prompt_token_ids"] = prompt
            return fields
    fields["prompt"] = prompt
    return fields


_MAPPINGS = {CHAT: _chat_fields, COMPLETIONS: _completion_fields, RESPONSES: responses_fields,
             EMBEDDINGS: _embedding_fields}


def output_line(job: Job | None, job_id: str, endpoint: str, vectors: bytes | None = None) -> dict[str, Any]:
    """The OpenAI Batch output line for one ended job (or one whose record expired); vectors: an embedding
    job's (producer/vectors.read_blobs)."""
    if job is None:
        return {"id": f"batch_req_{job_id}", "custom_id": None, "response": None,
                "error": {"code": "expired", "message": f"the record of job {job_id} expired (result_ttl)"}}
    line: dict[str, Any] = {"id": f"batch_req_{job_id}", "custom_id": job.custom_id}
    if job.status != JobStatus.finished or job.result is None:
        code = job.error_code or ("cancelled" if job.status == JobStatus.cancelled else "failed")
        message = job.error or f"job ended with status {job.status.value}"
        return line | {"response": None, "error": {"code": code, "message": message}}
    if endpoint == EMBEDDINGS and vectors is None:
        return line | {"response": None, "error": {"code": "expired", "message": f"the vectors of job {job_id} "
                                                   "are gone from Redis (expired, or dropped after an export)"}}
    response = {"status_code": 200, "request_id": job.id, "body": response_body(job, endpoint, vectors)}
    return line | {"response": response, "error": None}


def response_body(job: Job, endpoint: str, vectors: bytes | None = None) -> dict[str, Any]:
    """A finished job's answer as `endpoint` gives it (the HTTP body, a batch output line's response.body)."""
    if endpoint == RESPONSES:
        return response_object(job)
    if endpoint == EMBEDDINGS:
        return embeddings_response(job, vectors)
    result = job.result
    model = result.model or (job.request or {}).get("model") or "unknown"
    created = int(job.finished_at or job.created_at or 0)
    usage = result.usage.openai()
    top_n = (job.request or {}).get("logprobs")  # None: logprobs were not asked for
    if not isinstance(top_n, int) or isinstance(top_n, bool) or result.logprobs is None:
        top_n = None
    if endpoint == CHAT:
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": None if top_n is None else chat_logprobs(result, top_n, c),
                    "finish_reason": c.finish_reason} for c in result.all_choices()]
        return {"id": f"chatcmpl-{job.id}", "object": "chat.completion", "created": created, "model": model,
                "choices": choices, "usage": usage}
    choices = [{"index": c.index, "text": c.text, "finish_reason": c.finish_reason,
                "logprobs": None if top_n is None else completion_logprobs(result, c)}
               for c in result.all_choices()]
    return {"id": f"cmpl-{job.id}", "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage}


def _token(result: JobResult, token_id: int) -> tuple[str, list[int] | None]:
    """A token's text and bytes from the result (`token_id:N` and no bytes from a worker that wrote none)."""
    info = (result.logprob_tokens or {}).get(token_id)
    return (info.text, info.bytes) if info is not None else (f"token_id:{token_id}", None)


def _ranked(entry: dict[int, float]) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: (-kv[1], kv[0]))


def chat_logprobs(result: JobResult, top_n: int, choice: ResultChoice | None = None) -> dict[str, Any]:
    """OpenAI chat `logprobs` of one choice (default choice 0):
    {"content": [{token, logprob, bytes, top_logprobs: [top_n of them]}]}."""
    choice = choice or result.all_choices()[0]
    content = []
    for token_id, entry in zip(choice.token_ids, choice.logprobs or [], strict=False):
        text, raw = _token(result, token_id)
        top = []
        for alt_id, alt_lp in _ranked(entry)[:top_n]:
            alt_text, alt_raw = _token(result, alt_id)
            top.append({"token": alt_text, "logprob": alt_lp, "bytes": alt_raw})
        content.append({"token": text, "logprob": entry.get(token_id), "bytes": raw, "top_logprobs": top})
    return {"content": content, "refusal": None}


def completion_logprobs(result: JobResult, choice: ResultChoice | None = None) -> dict[str, Any]:
    """OpenAI completions `logprobs`: {tokens, token_logprobs, top_logprobs, text_offset}. top_logprobs holds
    the asked-for top n and the sampled token (up to n + 1, as OpenAI); text_offset counts characters of the
    generated text from 0 (no echo). One choice's (default choice 0)."""
    choice = choice or result.all_choices()[0]
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    offset = 0
    for token_id, entry in zip(choice.token_ids, choice.logprobs or [], strict=False):
        text, _ = _token(result, token_id)
        tokens.append(text)
        token_logprobs.append(entry.get(token_id))
        top_logprobs.append({_token(result, alt)[0]: lp for alt, lp in _ranked(entry)})
        text_offset.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}
