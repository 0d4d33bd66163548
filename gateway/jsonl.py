"""Validate an OpenAI Batch input file while it streams in, line by line, in constant memory per line.

The checks are those of producer.batches.parse_batch (each line through producer.openai_batch.parse_line,
one endpoint per file, unique custom_ids), and lines are numbered the way producer.batches.read_lines
numbers them (str.splitlines), so an error's line number is the one `tokenbus batch submit` would give.

Two kinds of problem, as OpenAI has them: a line whose content is wrong (bad JSON, a missing field, a
repeated custom_id) leaves the upload accepted, and a batch made from the file fails in `validating` with
`errors.data` naming each line. This gateway's limits (line length, max_tokens, lines per file) and a file
that is not UTF-8 text refuse the upload itself (400), since no batch of it could ever run.
"""

from __future__ import annotations

import json
from typing import Any

from producer.openai_batch import parse_line
from protocol.errors import MAX_ERRORS_SHOWN, InvalidJob


class _LineError(InvalidJob):
    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class BatchFileValidator:
    def __init__(self, max_line_bytes: int, max_tokens: int = 2**31 - 1, max_requests: int = 2**31 - 1) -> None:
        self.max_line_bytes, self.max_tokens, self.max_requests = max_line_bytes, max_tokens, max_requests
        self.limit_errors: list[tuple[int, str]] = []  # the first MAX_ERRORS_SHOWN: these refuse the upload
        self.limit_count = 0
        self.encoding_error: str | None = None
        self.error_codes: list[str] = []  # beside self.errors
        self.lines = 0  # lines seen (blank ones too): the next line's number is lines + 1
        self.requests = 0  # non-blank lines
        self.endpoint: str | None = None
        self.errors: list[tuple[int, str]] = []  # the first MAX_ERRORS_SHOWN
        self.error_count = 0
        self._buf = bytearray()
        self._skipping = False  # inside a line already reported as too long
        self._first_line: int | None = None
        self._seen: dict[str, int] = {}

    def feed(self, chunk: bytes) -> None:
        start = 0
        while True:
            nl = chunk.find(b"\n", start)
            if nl < 0:
                self._append(chunk[start:])
                return
            self._append(chunk[start:nl])
            self._end_segment()
            start = nl + 1

    def close(self) -> None:
        if self._buf or self._skipping:
            self._end_segment()

    def _append(self, data: bytes) -> None:
        if self._skipping or not data:
            return
        if len(self._buf) + len(data) > self.max_line_bytes:
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
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            self.lines += 1
            if self.encoding_error is None:
                self.encoding_error = (f"the file is not UTF-8 text: line {self.lines}, byte {err.start + 1} of the "
                                       "line is not valid UTF-8; save the file as UTF-8 (JSONL is UTF-8)")
            return
        # One segment between two newlines may hold several lines for str.splitlines (\r, \u2028 ...).
        for text_line in text.splitlines() or [""]:
            self.lines += 1
            if text_line.strip():
                self.requests += 1
                if self.requests == self.max_requests + 1:
                    self._limit(self.lines, f"the file has more than {self.max_requests} requests (the gateway's "
                                            "max_requests_per_file); split it into several batches")
                self._check(self.lines, text_line)

    def _check(self, number: int, text: str) -> None:
        try:
            try:
                json.loads(text)
            except ValueError as err:
                raise _LineError(f"not valid JSON ({err})", "invalid_json_line") from None
            except RecursionError:
                raise _LineError("not a batch line: its JSON is nested too deeply", "invalid_json_line") from None
            line, fields = parse_line(text)
            if self.endpoint is None:
                self.endpoint, self._first_line = line.url, number
            elif line.url != self.endpoint:
                raise _LineError(f"url {line.url} differs from the batch's endpoint {self.endpoint} (line "
                                 f"{self._first_line}); one batch has one endpoint", "mismatched_url")
            if line.custom_id in self._seen:
                raise _LineError(f"custom_id {line.custom_id!r} already used on line "
                                 f"{self._seen[line.custom_id]}", "duplicate_custom_id")
            self._seen[line.custom_id] = number
            if (asked := fields.get("max_tokens")) is not None and asked > self.max_tokens:
                self._limit(number, f"max_tokens {asked} is above this gateway's limit of {self.max_tokens}")
        except InvalidJob as err:
            self._error(number, str(err), getattr(err, "code", "invalid_request"))

    def _error(self, number: int, message: str, code: str = "invalid_request") -> None:
        self.error_count += 1
        if len(self.errors) < MAX_ERRORS_SHOWN:
            self.errors.append((number, message))
            self.error_codes.append(code)

    def _limit(self, number: int, message: str) -> None:
        self.limit_count += 1
        if len(self.limit_errors) < MAX_ERRORS_SHOWN:
            self.limit_errors.append((number, message))

    def problem(self) -> str | None:
        """Why the upload is refused (not UTF-8, no requests, a limit passed), or None."""
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
        """OpenAI's errors.data for a batch of this file: the invalid lines (first MAX_ERRORS_SHOWN), or None."""
        if not self.error_count:
            return None
        out = [{"code": code, "message": msg, "param": None, "line": n}
               for (n, msg), code in zip(self.errors, self.error_codes, strict=True)]
        if more := self.error_count - len(self.errors):
            out.append({"code": "too_many_errors", "message": f"... and {more} more invalid lines",
                        "param": None, "line": None})
        return out
