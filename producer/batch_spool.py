"""Pass 1 of a batch submit: the input read once as a stream, every line validated (producer/batch_file.py) and
its final request JSON written to a spool file on disk, so memory stays flat in the file's size.

The whole file must be valid before anything is written to Redis (one bad line refuses the batch), and the
record needs the line count; keeping the parsed lines in memory took ~3 KB a line (3 GB for a million lines).
The spool holds what pass 2 sends: one line per request, `json(custom_id) json(model) request_json`, read back
without validating anything again (producer/batches.py submit_batch, producer/submit_pipe.py).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from producer import openai_batch
from producer.batch_file import BatchFileReader
from protocol.errors import InvalidBatch
from protocol.models import JobRequest
from protocol.priority import Priority

READ_BYTES = 1 << 16
MAX_LINE_ERRORS = 1000  # bad lines remembered for the error (all are counted)

# stage ("validate" | "enqueue" | "export"), how much more is done, the stage's total (None: unknown)
Progress = Callable[[str, int, int | None], None]

# json.dumps / loads of one string, without their Python-level wrappers (the same text: dumps is ASCII-only)
_quote = json.encoder.encode_basestring_ascii
_unquote = json.decoder.scanstring


@dataclass
class Spooled:
    """A validated batch input: its endpoint, its requests (in the spool file) and where it came from."""

    endpoint: str
    total: int
    input_file: str | None
    spool: IO[str]
    models: set[str]  # the models its lines name ('' = none)

    def requests(self) -> Iterator[tuple[str, str, str]]:
        """(custom_id, model ('' = none), request JSON) of each line, in input order."""
        self.spool.seek(0)
        for line in self.spool:
            custom_id, end = _unquote(line, 1)
            model, end = _unquote(line, end + 2)
            yield custom_id, model, line[end + 1 : -1]

    def close(self) -> None:
        self.spool.close()


def spool_batch(
    source: str | Path | Iterable[str],
    model: str | None,
    priority: str,
    on_progress: Progress | None = None,
    spool_dir: str | Path | None = None,
) -> Spooled:
    """Validate `source` (a path, or lines) into a spool; InvalidBatch naming the bad lines (nothing spooled
    is kept). model / priority: set in every request (openai_batch.submit_fields), as submit_batch does."""
    spool = tempfile.TemporaryFile("w+", encoding="utf-8", dir=spool_dir, prefix="tokenbus-batch-")
    write = spool.write

    def keep(_line: int, custom_id: str, request: JobRequest, request_json: str) -> None:
        write(f"{_quote(custom_id)} {_quote(request.model or '')} {request_json}\n")

    reader = BatchFileReader(
        max_errors=MAX_LINE_ERRORS, on_request=keep, overrides=openai_batch.submit_fields(model, Priority(priority))
    )
    try:
        for _ in feed(reader, source, on_progress):
            pass
        problem = reader.problem("nothing was submitted")
        if problem:
            raise InvalidBatch(problem, line_errors=reader.errors)
    except BaseException:
        spool.close()
        raise
    spool.flush()
    return Spooled(reader.endpoint or "", reader.requests, name_of(source), spool, reader.models)


def name_of(source: str | Path | Iterable[str]) -> str | None:
    return str(source) if isinstance(source, str | Path) else None


def feed(
    reader: BatchFileReader,
    source: str | Path | Iterable[str],
    on_progress: Progress | None = None,
) -> Iterator[None]:
    """Feed `source` (a path, or lines) to the reader, yielding after each chunk; closes the reader at the end."""
    if isinstance(source, str | Path):
        path = Path(source)
        if not path.is_file():
            raise InvalidBatch(f"batch input file {str(path)!r} does not exist or is not a file")
        size = path.stat().st_size
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(READ_BYTES), b""):
                reader.feed(chunk)
                if on_progress is not None:
                    on_progress("validate", len(chunk), size)
                yield
    else:
        for text in source:  # one line each (a line may keep its newline)
            reader.feed(text.encode("utf-8", "surrogatepass"))
            if not text.endswith("\n"):
                reader.feed(b"\n")
            yield
    reader.close()
    yield


@dataclass
class Validated:
    """A batch file validated already (the gateway's upload checked every line as it streamed in): read in one
    pass, each line's request handed on as soon as it is validated again, with no spool. Should the file have
    changed since (a line now invalid, another count or endpoint), requests() raises InvalidBatch at the end,
    after the lines before the first bad one were handed on: the caller removes what it wrote
    (gateway/ingest.py)."""

    endpoint: str
    total: int
    source: str | Path
    model: str | None
    priority: str
    models: set[str] | None = None  # the models its lines name, when the first validation kept them

    @property
    def input_file(self) -> str | None:
        return name_of(self.source)

    def requests(self) -> Iterator[tuple[str, str, str]]:
        ready: list[tuple[int, str, str, str]] = []
        reader = BatchFileReader(
            max_errors=MAX_LINE_ERRORS,
            on_request=lambda n, cid, r, request_json: ready.append((n, cid, r.model or "", request_json)),
            overrides=openai_batch.submit_fields(self.model, Priority(self.priority)),
        )
        for _ in feed(reader, self.source):
            # nothing past the first bad line is handed on (the file is read on, for the whole error)
            first_bad = reader.errors[0][0] if reader.error_count else None
            for n, cid, model, request_json in ready:
                if first_bad is not None and n > first_bad:
                    break
                yield cid, model, request_json
            ready.clear()
        problem = reader.problem("the jobs written before it are removed")
        if not problem and (reader.requests, reader.endpoint) != (self.total, self.endpoint):
            problem = (
                f"the file changed since it was validated: it has {reader.requests} {reader.endpoint} "
                f"requests, not {self.total} {self.endpoint}"
            )
        if problem:
            raise InvalidBatch(problem, line_errors=reader.errors)

    def close(self) -> None:
        pass
