"""An OpenAI Batch input file read line by line as it streams in, in constant memory per line: the one set of
batch-file rules, for `tokenbus batch submit` (producer.batches) and the gateway's upload (gateway/files/store.py).

The rules: lines are numbered as str.splitlines numbers them (blank lines count and are skipped); each line is
UTF-8 and, when max_line_bytes is given, at most that long; each non-blank line is JSON and an OpenAI Batch
request (producer.openai_batch.batch_request); one endpoint per file; custom_ids unique; and, when given, no
line asks for more than max_tokens and the file holds at most max_requests requests.

The CLI refuses a file with any bad line (problem()). The gateway has OpenAI's two kinds of problem: a line
whose content is wrong (bad JSON, a missing field, a repeated custom_id) leaves the upload accepted, and a
batch made from the file fails in `validating` with `errors.data` naming each line (line_errors()); the
gateway's limits (line length, max_tokens, lines per file) and a file that is not UTF-8 text refuse the upload
itself (upload_problem(), 400), since no batch of it could ever run.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from pydantic_core import from_json as _from_json

from producer.openai_batch import batch_request
from producer.seen_ids import SeenIds
from protocol.embeddings import vector_bytes
from protocol.errors import MAX_ERRORS_SHOWN, InvalidJob
from protocol.models import JobRequest
from protocol.text import bounded, clip, surrogate_problem


def request_tokens(request: JobRequest) -> int:
    """What a job may cost in tokens: its prompt (about 4 bytes a token) plus max_tokens for each of n. The one
    estimate behind the gateway's per-key token limits (interactive and queued)."""
    if request.input is not None:  # an embedding: its inputs, and nothing generated
        return sum(len(x) if isinstance(x, list) else len(x.encode()) // 4 + 1 for x in request.embed_inputs())
    if request.prompt_token_ids is not None:
        prompt_tokens = len(request.prompt_token_ids)
    elif request.messages is not None:
        prompt_tokens = len("".join(m.content for m in request.messages).encode()) // 4
    else:
        prompt_tokens = len((request.prompt or "").encode()) // 4
    return prompt_tokens + request.max_tokens * request.n


RESULT_TOKEN_BYTES = 24  # a generated token in a stored result without logprobs (~18 measured, issue #34)
# a vector's width reserved when the request gives no `dimensions`: BGE-large's and most encoders' at most (384 for
# all-MiniLM-L6-v2, 4,096 for the 8B decoder embedders, which ask for dimensions or a larger reservation)
EMBED_RESERVE_WIDTH = 1024
LOGPROB_BYTES = 44  # one logprob entry of a token (its text, bytes, logprob): ~40 measured at top_logprobs 20


def result_bytes(request: JobRequest) -> int:
    """What a job's result may make Redis hold at most: max_tokens x n tokens, each with 1 + top_logprobs
    logprob entries when it asks for logprobs (854 bytes a token at 20, against 18 without). The one estimate
    behind the gateway's byte reservations of results (batches/capacity.py)."""
    if request.input is not None:  # an embedding: one vector per input, its width unknown before a worker runs it
        width = request.dimensions or EMBED_RESERVE_WIDTH
        return len(request.embed_inputs()) * vector_bytes(width, request.embedding_dtype)
    entries = 0 if request.logprobs is None else 1 + request.logprobs
    return request.max_tokens * request.n * (RESULT_TOKEN_BYTES + entries * LOGPROB_BYTES)


def max_tokens_problem(request: JobRequest, limit: int | None) -> str | None:
    """Why a request asks for more than the gateway's max_tokens limit, or None. Only a max_tokens the request
    gives counts: the default is the worker's, not the caller's."""
    if limit is None or "max_tokens" not in request.model_fields_set or request.max_tokens <= limit:
        return None
    return f"max_tokens {request.max_tokens} is above this gateway's limit of {limit}"


class _LineError(InvalidJob):
    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class BatchFileReader:
    """feed() the file's bytes in chunks of any size, then close(); problem() says what is wrong, if anything.

    keep: hold each valid line's (custom_id, JobRequest) in `parsed` (small files and tests); on_request(line
    number, custom_id, request, request JSON) gets each valid line as it is read instead (the CLI's submit
    and the gateway's upload spool them, in memory flat in the file's size: batch_spool.spool_writer).
    max_errors: bad lines remembered (error_count counts them all; None = every one). overrides: request fields
    every line gets (openai_batch.batch_request).
    max_line_bytes, max_tokens, max_requests: the gateway's limits (None = none)."""

    def __init__(self, max_line_bytes: int | None = None, keep: bool = False,
                 max_errors: int | None = MAX_ERRORS_SHOWN, max_tokens: int | None = None,
                 max_requests: int | None = None,
                 on_request: Callable[[int, str, JobRequest, str], None] | None = None,
                 overrides: dict[str, Any] | None = None) -> None:
        self.max_line_bytes = max_line_bytes
        self.keep, self.on_request, self.overrides = keep, on_request, overrides
        self.max_errors = max_errors
        self.max_tokens, self.max_requests = max_tokens, max_requests
        self.lines = 0  # lines seen (blank ones too): the next line's number is lines + 1
        self.requests = 0  # non-blank lines
        self.tokens = 0  # what the valid lines may cost: prompt + max_tokens x n each (request_tokens)
        self.result_bytes = 0  # what their results may hold in Redis, logprobs included (result_bytes)
        self.endpoint: str | None = None
        self.models: set[str] = set()  # the models the valid lines name ('' = none: the default queues)
        self.parsed: list[tuple[str, JobRequest]] = []
        self.errors: list[tuple[int, str]] = []  # (line number, message), the first max_errors
        self.error_codes: list[str] = []  # beside self.errors
        self.error_count = 0
        self.limit_errors: list[tuple[int, str]] = []  # the first MAX_ERRORS_SHOWN: these refuse an upload
        self.limit_count = 0
        self.encoding_error: str | None = None  # the first line that is not UTF-8: refuses an upload
        self._buf = bytearray()
        self._skipping = False  # inside a line already reported as too long
        self._first_line: int | None = None
        self._seen = SeenIds()  # custom_id -> its first line, ~12 bytes a line

    def feed(self, chunk: bytes) -> None:
        parts = chunk.split(b"\n")
        self._append(parts[0])
        if len(parts) == 1:
            return
        self._end_segment()
        limit, segment = self.max_line_bytes, self._segment
        for i in range(1, len(parts) - 1):  # whole lines: nothing buffered before them
            part = parts[i]
            if limit is not None and len(part) > limit:
                self._append(part)
                self._end_segment()
            else:
                segment(part)
        self._append(parts[-1])

    def close(self) -> None:
        if self._buf or self._skipping:
            self._end_segment()

    def _append(self, data: bytes) -> None:
        if self._skipping or not data:
            return
        if self.max_line_bytes is not None and len(self._buf) + len(data) > self.max_line_bytes:
            self.lines += 1
            self._limit(self.lines, f"longer than {self.max_line_bytes} bytes (the gateway's max_line_bytes)")
            self.requests += 1
            self._buf.clear()
            self._skipping = True
            return
        self._buf.extend(data)

    def _end_segment(self) -> None:
        if self._skipping:  # the too-long line was counted when it overflowed
            self._skipping = False
            return
        raw, self._buf = bytes(self._buf), bytearray()
        self._segment(raw)

    def _segment(self, raw: bytes) -> None:
        """The bytes between two newlines."""
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            self.lines += 1
            self._error(self.lines, f"not UTF-8 text (byte {err.start + 1} of the line); save the file as UTF-8",
                        "invalid_encoding")
            if self.encoding_error is None:
                self.encoding_error = (f"the file is not UTF-8 text: line {self.lines}, byte {err.start + 1} of the "
                                       "line is not valid UTF-8; save the file as UTF-8 (JSONL is UTF-8)")
            return
        # One segment between two newlines may hold several lines for str.splitlines (\r, \u2028 ...).
        for text_line in text.splitlines() or [""]:
            self.lines += 1
            if text_line.strip():
                self.requests += 1
                if self.max_requests is not None and self.requests == self.max_requests + 1:
                    self._limit(self.lines, f"the file has more than {self.max_requests} requests (the gateway's "
                                            "max_requests_per_file); split it into several batches")
                self._check(self.lines, text_line)

    def _check(self, number: int, text: str) -> None:
        try:
            # pydantic's JSON parser (jiter) reads a line in less than half json.loads's time and gives the same
            # values; what it refuses (a lone surrogate escape, an integer past 4,300 digits, deep nesting, bad
            # JSON) json.loads judges, as before, with its own message
            try:
                raw = _from_json(text, cache_strings="keys")
            except ValueError:
                try:
                    raw = json.loads(text)
                except ValueError as err:
                    raise _LineError(f"not valid JSON ({err})", "invalid_json_line") from None
                except RecursionError:
                    raise _LineError("not a batch line: its JSON is nested too deeply", "invalid_json_line") from None
                if bad := surrogate_problem(text.encode("utf-8", "surrogatepass"), raw):
                    self._unstorable(number, bad[1])
                    return
            custom_id, url, request, request_json = batch_request(raw, self.overrides)
            if self.endpoint is None:
                self.endpoint, self._first_line = url, number
            elif url != self.endpoint:
                raise _LineError(f"url {url} differs from the batch's endpoint {self.endpoint} (line "
                                 f"{self._first_line}); one batch has one endpoint", "mismatched_url")
            if (first := self._seen.add(custom_id, number)) is not None:
                raise _LineError(f"custom_id {clip(custom_id)} already used on line {first}", "duplicate_custom_id")
            if problem := max_tokens_problem(request, self.max_tokens):
                self._limit(number, problem)
            self.tokens += request_tokens(request)
            self.models.add(request.model or "")
            self.result_bytes += result_bytes(request)
            if self.keep:
                self.parsed.append((custom_id, request))
            if self.on_request is not None:
                self.on_request(number, custom_id, request, request_json)
        except InvalidJob as err:
            self._error(number, str(err), getattr(err, "code", "invalid_request"))

    def _error(self, number: int, message: str, code: str = "invalid_request") -> None:
        self.error_count += 1
        if self.max_errors is None or len(self.errors) < self.max_errors:
            self.errors.append((number, bounded(message)))  # kept in the file's and its batches' records
            self.error_codes.append(code)

    def _unstorable(self, number: int, message: str) -> None:
        """A line whose text Redis cannot store (a lone surrogate): refuses an upload as non-UTF-8 bytes do,
        since the submit would crash on it."""
        self._error(number, message, "invalid_encoding")
        if self.encoding_error is None:
            self.encoding_error = f"line {number} is not storable text: {message}"

    def _limit(self, number: int, message: str) -> None:
        """A line past one of the gateway's limits: refuses an upload, and is a bad line for problem()."""
        self._error(number, message, "limit_exceeded")
        self.limit_count += 1
        if len(self.limit_errors) < MAX_ERRORS_SHOWN:
            self.limit_errors.append((number, message))

    def problem(self, outcome: str) -> str | None:
        """None for a valid file; else a message naming each bad line (the first MAX_ERRORS_SHOWN) and, after
        `outcome` (what did not happen: "nothing was submitted"), how many more there are."""
        if not self.error_count:
            return None if self.requests else "the batch file has no requests (no non-blank lines)"
        shown = "\n  ".join(f"line {n}: {msg}" for n, msg in self.errors[:MAX_ERRORS_SHOWN])
        more = self.error_count - min(len(self.errors), MAX_ERRORS_SHOWN)
        tail = f"\n  ... and {more} more" if more else ""
        return f"{self.error_count} of {self.requests} lines are invalid; {outcome}:\n  {shown}{tail}"

    def upload_problem(self) -> str | None:
        """Why the gateway refuses the upload (not UTF-8, no requests, a limit passed), or None: bad lines
        otherwise leave it stored (line_errors)."""
        if self.encoding_error:
            return self.encoding_error
        if self.limit_count:
            shown = "\n  ".join(f"line {n}: {msg}" for n, msg in self.limit_errors)
            more = self.limit_count - len(self.limit_errors)
            tail = f"\n  ... and {more} more" if more else ""
            return (f"{self.limit_count} of {self.requests} lines pass this gateway's limits; the file was not "
                    f"stored:\n  {shown}{tail}")
        return None if self.requests else "the file has no requests (no non-blank lines)"

    def line_errors(self) -> list[dict[str, Any]] | None:
        """OpenAI's errors.data for a batch of this file: the invalid lines (the first max_errors), or None."""
        if not self.error_count:
            return None
        out = [{"code": code, "message": msg, "param": None, "line": n}
               for (n, msg), code in zip(self.errors, self.error_codes, strict=True)]
        if more := self.error_count - len(self.errors):
            out.append({"code": "too_many_errors", "message": f"... and {more} more invalid lines",
                        "param": None, "line": None})
        return out
