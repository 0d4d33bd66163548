"""The wire protocol between producers and workers: a job's request, its limits and checks (key names in
protocol/keys.py, priorities in protocol/priority.py; a job's record and result in protocol/jobs.py, re-exported
here).

This module is the source of truth for docs/protocol.md. It imports no torch: clients in other processes
(and other languages, via the doc) only need Redis and these shapes.
"""

from __future__ import annotations

import json
import math
import re
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticSerializationError

from protocol.constraints import check_choice, check_regex, check_response_format, grammar_error, grammar_for
from protocol.embeddings import EMBED_FIELDS, EmbedDtype, EncodingFormat, as_inputs, check_input
from protocol.errors import ErrorCode, InvalidJob  # noqa: F401  (ErrorCode: part of the protocol)
from protocol.jobs import TERMINAL_STATUSES, Job, JobResult, JobStatus, ResultChoice, TokenText, Usage  # noqa: F401
from protocol.priority import Priority
from protocol.registry import model_name_problem

GROUP = "workers"  # the one consumer group, on every job queue
# 127.0.0.1, not localhost: localhost may resolve to ::1 first, where a default Redis does not listen
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_MAX_QUEUE_LEN = 1_000_000
DEFAULT_RESULT_TTL = 7 * 24 * 3600  # seconds a finished job's record (and a batch) is kept
EVENTS_MAXLEN = 100_000  # approximate cap of {ns}:events
MAX_LOGPROBS = 20
MAX_ID_LEN = 200
# Job and batch ids. No ':' (the key separator): with it, job `V:tokens` would be job V's token stream and
# batch `C:jobs` batch C's job list. \A...\Z: `$` would also match before a final newline.
JOB_ID_RE = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9_.@-]{0,199}\Z")
ID_CHARS = "A-Z a-z 0-9 _ . @ -"
# Size bounds of one request, checked by the client before writing and by workers on every entry.
MAX_REQUEST_BYTES = 1 << 20  # the request JSON, UTF-8 bytes
MAX_COUNT = 2**31 - 1  # max_tokens, min_tokens, top_k, token ids (any model's vocabulary is far smaller)
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1  # what a torch generator accepts
MAX_CHOICES = 32  # n: completions of one prompt
# Stop lists are checked after every token for everyone sharing the step: bounded in count and length (OpenAI
# allows 4 strings), and matched by one automaton over the text's tail, at a cost independent of their number
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1000  # one stop string's length, in characters
MAX_STOP_TOKEN_IDS = 256


class BatchStatus(StrEnum):
    validating = "validating"  # record written, jobs being submitted
    in_progress = "in_progress"
    completed = "completed"
    cancelling = "cancelling"
    cancelled = "cancelled"


TERMINAL_BATCH_STATUSES = frozenset({BatchStatus.completed, BatchStatus.cancelled})


# Wire models are strict: "64" is not an int and 1 is not a bool, so a typo fails at submit, not on a GPU.
_STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class GenerationParams(BaseModel):
    """The generation fields of a job: their one definition. The engine's SamplingParams is this class plus
    what it derives (worker/engine/sampling_params.py), so both sides accept and refuse the same values."""

    model_config = _STRICT

    max_tokens: int = Field(256, ge=1, le=MAX_COUNT)
    min_tokens: int = Field(0, ge=0, le=MAX_COUNT)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=MAX_COUNT)  # 0 = off
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=MIN_SEED, le=MAX_SEED)  # choice i of n draws with seed + i
    n: int = Field(1, ge=1, le=MAX_CHOICES)  # completions of the prompt (OpenAI `n`), sharing its KV blocks
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    skip_special_tokens: bool = True
    # structured output, at most one per job (protocol/constraints.py): OpenAI's {"type": "json_object"} or
    # {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}; a regex the output must match
    # as a whole; or a list of strings the output must be one of
    response_format: dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        return check_response_format(v)

    @field_validator("regex")
    @classmethod
    def _regex(cls, v: str | None) -> str | None:
        return check_regex(v)

    @field_validator("choice")
    @classmethod
    def _choice(cls, v: list[str] | None) -> list[str] | None:
        return check_choice(v)

    @field_validator("stop")
    @classmethod
    def _stop_bounded(cls, v: str | list[str] | None) -> str | list[str] | None:
        strings = [v] if isinstance(v, str) else v or []
        if len(strings) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings (got {len(strings)}); keep the ones that matter")
        for s in strings:
            if s == "":
                raise ValueError("stop strings must not be empty")
            if len(s) > MAX_STOP_CHARS:
                raise ValueError(f"a stop string has {len(s)} characters; at most {MAX_STOP_CHARS}")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _ids_not_negative(cls, v: list[int] | None) -> list[int] | None:
        if v and len(v) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids (got {len(v)})")
        if v and min(v) < 0:
            raise ValueError("token ids must be >= 0")
        if v and max(v) > MAX_COUNT:
            raise ValueError(f"token ids must be <= {MAX_COUNT} (and below the model's vocabulary size)")
        return v

    @model_validator(mode="after")
    def _min_le_max(self) -> GenerationParams:
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.seed is not None and self.seed + self.n - 1 > MAX_SEED:
            raise ValueError(f"seed + n - 1 must be <= {MAX_SEED}: choice i uses seed + i")
        # (no constraint, the common case: no grammar to build; checked here as it is run for every request)
        unconstrained = self.response_format is None and self.regex is None and self.choice is None
        grammar = None if unconstrained else grammar_for(self.response_format, self.regex, self.choice)
        if grammar is not None:
            # the grammar decides where the output may end: forcing it on would contradict the grammar
            if self.min_tokens or self.ignore_eos:
                raise ValueError("min_tokens and ignore_eos cannot be combined with response_format, regex or choice")
            error = grammar_error(grammar)
            if error:
                what = "regex" if self.regex is not None else "choice" if self.choice is not None else \
                    "response_format JSON schema"
                raise ValueError(f"the {what} cannot be compiled: {' '.join(error.split())[:400]}")
        return self

    def constraint_grammar(self) -> str | None:
        """The llguidance grammar text of this job's constraint (protocol/constraints.py), None without one."""
        return grammar_for(self.response_format, self.regex, self.choice)

    def sampling_fields(self) -> dict[str, Any]:
        """kwargs for worker SamplingParams(**...): only the generation fields."""
        return {name: getattr(self, name) for name in GenerationParams.model_fields}


class Message(BaseModel):
    model_config = _STRICT

    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = None


# built once: _one_prompt runs for every request (every line of a batch file)
_GENERATION_FIELDS = frozenset(GenerationParams.model_fields)
_EMBED_FIELD_SET = frozenset(EMBED_FIELDS)


class JobRequest(GenerationParams):
    """One job: exactly one of prompt / messages / prompt_token_ids (a generation, plus its generation fields),
    or `input` (an embedding job, OpenAI's embeddings request: protocol/embeddings.py)."""

    prompt: str | None = None
    messages: list[Message] | None = None
    prompt_token_ids: list[int] | None = None
    # embedding jobs: a string, a list of strings, a list of token ids, or a list of such lists
    input: str | list[Any] | None = None
    encoding_format: EncodingFormat = "float"  # how the front doors render the vectors (OpenAI's)
    dimensions: int | None = Field(None, ge=1, le=MAX_COUNT)  # Matryoshka: the first `dimensions` entries
    truncate: bool = False  # cut an input longer than the model's embedding context instead of refusing it
    embedding_dtype: EmbedDtype = "float32"  # how the vectors are stored in Redis (float16: half the bytes)
    model: str | None = None  # picks its model's queues (a declared name, checked at submit); None: the default
    stream: bool = False  # publish partial tokens (worker option)
    # the queue it waits on: every worker's intake serves interactive, then default, then bulk
    priority: Priority = Field(Priority.default, strict=False)  # strict=False: its value given as a str
    metadata: dict[str, str] | None = None  # caller's labels, returned untouched

    @field_validator("model")
    @classmethod
    def _model_name(cls, v: str | None) -> str | None:
        problem = model_name_problem(v) if v is not None else None
        if problem:
            raise ValueError(f"{problem} (it becomes a part of its queue's Redis key)")
        return v

    @field_validator("input")
    @classmethod
    def _input(cls, v: str | list[Any] | None) -> str | list[Any] | None:
        if v is not None:
            check_input(v)
        return v

    @model_validator(mode="after")
    def _one_prompt(self) -> JobRequest:
        given = [n for n in ("prompt", "messages", "prompt_token_ids", "input") if getattr(self, n) is not None]
        if len(given) != 1:
            what = "none" if not given else " and ".join(given)
            raise ValueError(f"give exactly one of prompt, messages, prompt_token_ids (got {what}), or input for an "
                             "embedding job")
        if self.input is not None:
            wrong = sorted((self.model_fields_set & _GENERATION_FIELDS) | (
                {"stream"} if self.stream else set()))
            if wrong:
                raise ValueError(f"an embedding job (input) takes no generation fields: {', '.join(wrong)}")
            return self
        wrong = sorted(self.model_fields_set & _EMBED_FIELD_SET)
        if wrong:
            raise ValueError(f"{', '.join(wrong)} apply to embedding jobs (input) only")
        if self.prompt is not None and self.prompt == "":
            raise ValueError("prompt must not be empty")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
        if self.prompt_token_ids is not None:
            if not self.prompt_token_ids:
                raise ValueError("prompt_token_ids must not be empty")
            if min(self.prompt_token_ids) < 0:
                raise ValueError("prompt_token_ids must be >= 0")
            if max(self.prompt_token_ids) > MAX_COUNT:
                raise ValueError(f"prompt_token_ids must be <= {MAX_COUNT} (and below the model's vocabulary size)")
        return self

    @property
    def kind(self) -> str:
        """The job's kind, as ModelRecord.kinds names them: "embed" with `input`, else "generate"."""
        return "embed" if self.input is not None else "generate"

    def embed_inputs(self) -> list[str] | list[list[int]]:
        """An embedding job's inputs, one per vector, in order ([] for a generation); checked once, when the
        request was validated (_input), not again on every call."""
        return as_inputs(self.input) if self.input is not None else []

    @property
    def seats(self) -> int:
        """Engine sequences the job takes: one per input of an embedding, n for a generation."""
        return len(self.embed_inputs()) if self.input is not None else self.n

    def engine_prompt(self) -> str | list[int] | list[dict[str, str]]:
        """What Engine.add_request takes as its prompt."""
        if self.prompt is not None:
            return self.prompt
        if self.prompt_token_ids is not None:
            return list(self.prompt_token_ids)
        return [m.model_dump(exclude_none=True) for m in self.messages or []]

    def to_json(self) -> str:
        """The request JSON; InvalidJob if it is not valid UTF-8 text or larger than MAX_REQUEST_BYTES."""
        # Defaults are left out: the record stays small and a reader applies the same defaults.
        try:  # model_dump_json's own call, for its bytes: their size is the limit's (run for every request)
            raw = self.__pydantic_serializer__.to_json(self, exclude_defaults=True)
        except PydanticSerializationError as err:  # e.g. a lone surrogate ("\ud800"): not encodable as UTF-8
            raise InvalidJob(f"invalid job: a text field is not valid Unicode text ({err})") from None
        check_request_size(len(raw))
        return raw.decode()


def is_valid_id(value: object) -> bool:
    """A job or batch id: 1-200 of A-Z a-z 0-9 _ . @ -, starting with a letter or digit (no ':')."""
    return isinstance(value, str) and JOB_ID_RE.fullmatch(value) is not None


def check_job_id(job_id: str, what: str = "job id") -> str:
    if not is_valid_id(job_id):
        raise InvalidJob(
            f"invalid {what} {_short(job_id)}: use 1-{MAX_ID_LEN} characters from {ID_CHARS} "
            "(starting with a letter or digit; no ':', which separates the parts of Redis keys)"
        )
    return job_id


def batch_job_id(batch_id: str, index: int) -> str:
    """The id of a batch's job: `{batch_id}-{index}`, index from 0 in input order."""
    return f"{batch_id}-{index}"


def check_batch_id(batch_id: str, total: int) -> str:
    """A batch id whose every job id `{batch_id}-{i}` (i < total) is a valid job id, or InvalidJob."""
    check_job_id(batch_id, "batch id")
    longest = batch_job_id(batch_id, max(total - 1, 0))
    if not is_valid_id(longest):
        room = MAX_ID_LEN - len(longest) + len(batch_id)
        raise InvalidJob(
            f"batch id {batch_id!r} is too long for {total} requests: its last job id {longest!r} would have "
            f"{len(longest)} characters (at most {MAX_ID_LEN}); use a batch id of at most {room} characters"
        )
    return batch_id


def check_request_size(size: int) -> None:
    if size > MAX_REQUEST_BYTES:
        raise InvalidJob(
            f"invalid job: the request is {size} bytes of JSON, more than the limit of {MAX_REQUEST_BYTES} "
            "(MAX_REQUEST_BYTES); shorten the prompt or split the work into several jobs"
        )


def describe_validation_error(err: ValidationError) -> str:
    """One line per problem: `field: what is wrong (got value)`."""
    allowed = ", ".join(JobRequest.model_fields)
    lines = []
    for e in err.errors(include_url=False):
        loc = ".".join(str(p) for p in e["loc"]) or "request"
        if e["type"] == "extra_forbidden":
            lines.append(f"{loc}: unknown field (allowed: {allowed})")
            continue
        msg = e["msg"].removeprefix("Value error, ")
        got = e.get("input")
        shown = "" if isinstance(got, dict) else f" (got {_short(got)})"
        lines.append(f"{loc}: {msg}{shown}")
    return "; ".join(lines)


def _short(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 200:
        return f"an integer of about {int(value.bit_length() * 0.30103) + 1} digits"
    try:
        text = repr(value)
    except (ValueError, RecursionError):  # a huge int nested somewhere, or a very deep structure
        return f"a {type(value).__name__} too large to show"
    if isinstance(value, float) and not math.isfinite(value):
        return text
    return text if len(text) <= 60 else text[:57] + "..."


def validate_request(data: dict[str, Any] | JobRequest) -> JobRequest:
    """A JobRequest from a dict, or InvalidJob saying every field that is wrong."""
    if isinstance(data, JobRequest):
        return data
    if not isinstance(data, dict):
        raise InvalidJob(f"invalid job: a request must be a JSON object / dict, got {type(data).__name__}")
    try:
        return JobRequest.model_validate(data)
    except ValidationError as err:
        raise InvalidJob(f"invalid job: {describe_validation_error(err)}") from None


def parse_request(raw: str | bytes) -> JobRequest:
    """What a worker calls on an entry's `request` field: JSON text -> JobRequest or InvalidJob.

    Whatever the text holds, the only exception is InvalidJob: a huge integer (ValueError from the int
    digits limit), deep nesting (RecursionError) or bad UTF-8 fail this request, never its reader."""
    size = len(raw) if isinstance(raw, bytes) else len(raw.encode("utf-8", "surrogatepass"))
    check_request_size(size)
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise InvalidJob(f"invalid job: request is not valid UTF-8 ({err})") from None
    try:
        data = json.loads(raw)
    except RecursionError:
        raise InvalidJob("invalid job: request JSON is nested too deeply (a request has 3 levels: request, "
                         "messages, message; only a response_format JSON schema nests further)") from None
    except ValueError as err:  # JSONDecodeError, and an integer past Python's digits limit
        raise InvalidJob(f"invalid job: request is not valid JSON ({err})") from None
    request = validate_request(data)
    try:
        request.model_dump_json()
    except PydanticSerializationError:
        raise InvalidJob("invalid job: a text field holds a lone surrogate (\\ud800-\\udfff escape): "
                         "not valid Unicode text") from None
    return request
