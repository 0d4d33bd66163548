"""Pass 1 of a batch submit: the input read once as a stream, every line validated (producer/batch_file.py) and
its final request JSON written to a spool file on disk, so memory stays flat in the file's size.

The whole file must be valid before anything is written to Redis (one bad line refuses the batch), and the
record needs the line count; keeping the parsed lines in memory took ~3 KB a line (3 GB for a million lines).
The spool holds what pass 2 sends: one line per request, `json(custom_id) json(model) request_json` (model ''
= none), read back without parsing or validating the request again (producer/batches.py submit_batch,
producer/submit_pipe.py). The gateway's upload writes the same spool beside the file as it streams in
(spool_writer), and its submit task opens it (open_spool): the file is validated once, in the upload.

A spool written here is sent in prefix order: lines whose prompts start alike together, each with its input
index (producer/prefix_order.py, keyed as the lines stream in). A spool opened from the gateway's upload is
sent in the prefix order its upload kept beside it (open_spool's `order`), else in input order.
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
from producer.prefix_order import PrefixOrder
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
    """A validated batch input: its endpoint, its requests (in the spool file, their queue's priority set in
    each) and where it came from."""

    endpoint: str
    total: int
    input_file: str | None
    spool: IO[str]
    priority: str = Priority.bulk
    models: set[str] | None = None  # the models its lines name ('' = none); None: not known
    order: PrefixOrder | None = None  # each line's prefix group and place in the spool (None: input order)

    def requests(self) -> Iterator[tuple[int, str, str, str]]:
        """(input index, custom_id, model ('' = none), request JSON) of each line: group by group where lines of
        one prefix lie apart (prefix_order.py), else in input order; InvalidBatch at the end when the spool holds
        another count than `total` (a spool changed since it was written: the caller removes what it sent)."""
        self.spool.seek(0)
        count = 0
        if self.order is not None and self.order.reorders:
            raw = self.spool.buffer  # the lines are ASCII (_quote, json.dumps): their byte offsets are exact
            for i in self.order.order():
                raw.seek(self.order.offsets[i])
                count += 1
                yield i, *_spool_line(raw.readline().decode("ascii"))
        else:
            for line in self.spool:
                yield count, *_spool_line(line)
                count += 1
        if count != self.total:
            raise InvalidBatch(f"the validated requests changed since they were written: the spool holds {count} "
                               f"requests, not {self.total}")

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
    order = PrefixOrder()
    reader = BatchFileReader(
        max_errors=MAX_LINE_ERRORS,
        on_request=spool_writer(spool, order),
        overrides=openai_batch.submit_fields(model, Priority(priority)),
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
    return Spooled(reader.endpoint or "", reader.requests, name_of(source), spool, Priority(priority).value,
                   reader.models, order)


def _spool_line(line: str) -> tuple[str, str, str]:
    """(custom_id, model ('' = none), request JSON) of one spool line."""
    custom_id, end = _unquote(line, 1)
    model = ""
    if line[end + 1] == '"':  # a spool written before models has none: its request JSON follows
        model, end = _unquote(line, end + 2)
    return custom_id, model, line[end + 1 : -1]


def spool_writer(spool: IO[str], order: PrefixOrder | None = None) -> Callable[[int, str, JobRequest, str], None]:
    """A BatchFileReader's on_request that writes each valid line to `spool` as `json(custom_id) json(model)
    request_json` (and, with `order`, keys its prefix there)."""
    write = spool.write

    def keep(_line: int, custom_id: str, request: JobRequest, request_json: str) -> None:
        line = f"{_quote(custom_id)} {_quote(request.model or '')} {request_json}\n"
        write(line)
        if order is not None:
            order.add(request, len(line))

    return keep


def open_spool(path: str | Path, endpoint: str, total: int, priority: str, input_file: str | None = None,
               models: Iterable[str] | None = None, order_path: str | Path | None = None) -> Spooled:
    """A spool written already (spool_writer, the gateway's upload) of `total` requests of `endpoint`, whose
    requests were validated with `priority` set (and name `models`): sent as they are, nothing parsed or
    validated again; in the prefix order kept at `order_path` (PrefixOrder.save) where it fits the spool."""
    path = Path(path)
    order = None if order_path is None else PrefixOrder.load(order_path, total, path.stat().st_size)
    return Spooled(endpoint, total, input_file, path.open(encoding="utf-8"), Priority(priority).value,
                   set(models) if models is not None else None, order)


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
