"""An OpenAI Batch input file read line by line as it streams in, in constant memory per line: the one set of
batch-file rules, for `tokenbus batch submit` (producer.batches) and the gateway's upload (gateway/files.py).

The rules: lines are numbered as str.splitlines numbers them (blank lines count and are skipped); each line is
UTF-8 and, when max_line_bytes is given, at most that long; each non-blank line is an OpenAI Batch request
(producer.openai_batch.parse_line); one endpoint per file; custom_ids unique.
"""

from __future__ import annotations

from producer.openai_batch import parse_line
from protocol.errors import MAX_ERRORS_SHOWN, InvalidJob
from protocol.models import JobRequest


class BatchFileReader:
    """feed() the file's bytes in chunks of any size, then close(); problem() says what is wrong, if anything.

    keep: hold each valid line's (custom_id, JobRequest) in `parsed` (the CLI submits them; the gateway's
    upload only checks). max_errors: bad lines remembered (error_count counts them all; None = every one)."""

    def __init__(self, max_line_bytes: int | None = None, keep: bool = False,
                 max_errors: int | None = MAX_ERRORS_SHOWN) -> None:
        self.max_line_bytes = max_line_bytes
        self.keep = keep
        self.max_errors = max_errors
        self.lines = 0  # lines seen (blank ones too): the next line's number is lines + 1
        self.requests = 0  # non-blank lines
        self.endpoint: str | None = None
        self.parsed: list[tuple[str, JobRequest]] = []
        self.errors: list[tuple[int, str]] = []  # (line number, message), the first max_errors
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
        if self.max_line_bytes is not None and len(self._buf) + len(data) > self.max_line_bytes:
            self.lines += 1
            self._error(self.lines, f"longer than {self.max_line_bytes} bytes (the gateway's max_line_bytes)")
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
            self._error(self.lines, f"not UTF-8 text (byte {err.start + 1} of the line); save the file as UTF-8")
            return
        # One segment between two newlines may hold several lines for str.splitlines (\r, \u2028 ...).
        for text_line in text.splitlines() or [""]:
            self.lines += 1
            if text_line.strip():
                self.requests += 1
                self._check(self.lines, text_line)

    def _check(self, number: int, text: str) -> None:
        try:
            line, request = parse_line(text)
            if self.endpoint is None:
                self.endpoint, self._first_line = line.url, number
            elif line.url != self.endpoint:
                raise InvalidJob(f"url {line.url} differs from the batch's endpoint {self.endpoint} (line "
                                 f"{self._first_line}); one batch has one endpoint")
            if line.custom_id in self._seen:
                raise InvalidJob(f"custom_id {line.custom_id!r} already used on line {self._seen[line.custom_id]}")
            self._seen[line.custom_id] = number
            if self.keep:
                self.parsed.append((line.custom_id, request))
        except InvalidJob as err:
            self._error(number, str(err))

    def _error(self, number: int, message: str) -> None:
        self.error_count += 1
        if self.max_errors is None or len(self.errors) < self.max_errors:
            self.errors.append((number, message))

    def problem(self, outcome: str) -> str | None:
        """None for a valid file; else a message naming each bad line (the first MAX_ERRORS_SHOWN) and, after
        `outcome` (what did not happen: "the file was not stored"), how many more there are."""
        if not self.error_count:
            return None if self.requests else "the batch file has no requests (no non-blank lines)"
        shown = "\n  ".join(f"line {n}: {msg}" for n, msg in self.errors[:MAX_ERRORS_SHOWN])
        more = self.error_count - min(len(self.errors), MAX_ERRORS_SHOWN)
        tail = f"\n  ... and {more} more" if more else ""
        return f"{self.error_count} of {self.requests} lines are invalid; {outcome}:\n  {shown}{tail}"
