"""Pass 1 of a batch submit: the input read once as a stream, every line validated (producer/batch_file.py) and
its final request JSON written to a spool file on disk, so memory stays flat in the file's size.

The whole file must be valid before anything is written to Redis (one bad line refuses the batch), and the
record needs the line count; keeping the parsed lines in memory took ~3 KB a line (3 GB for a million lines).
The spool holds what pass 2 sends: one line per request, `json(custom_id) request_json`, read back without
validating anything again (producer/batches.py submit_batch, producer/submit_pipe.py).
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
from protocol.models import JobRequest, Priority

READ_BYTES = 1 << 16
MAX_LINE_ERRORS = 1000  # bad lines remembered for the error (all are counted)

# stage ("validate" | "enqueue" | "export"), how much more is done, the stage's total (None: unknown)
Progress = Callable[[str, int, int | None], None]

_DECODER = json.JSONDecoder()


@dataclass
class Spooled:
    """A validated batch input: its endpoint, its requests (in the spool file) and where it came from."""

    endpoint: str
    total: int
    input_file: str | None
    spool: IO[str]

    def requests(self) -> Iterator[tuple[str, str]]:
        """(custom_id, request JSON) of each line, in input order."""
        self.spool.seek(0)
        for line in self.spool:
            custom_id, end = _DECODER.raw_decode(line)
            yield custom_id, line[end + 1 : -1]

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
    write, dumps = spool.write, json.dumps

    def keep(_line: int, custom_id: str, _request: JobRequest, request_json: str) -> None:
        write(f"{dumps(custom_id)} {request_json}\n")

    reader = BatchFileReader(
        max_errors=MAX_LINE_ERRORS, on_request=keep, overrides=openai_batch.submit_fields(model, Priority(priority))
    )
    name: str | None = None
    try:
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
            name = str(path)
        else:
            for text in source:  # one line each (a line may keep its newline)
                reader.feed(text.encode("utf-8", "surrogatepass"))
                if not text.endswith("\n"):
                    reader.feed(b"\n")
        reader.close()
        problem = reader.problem("nothing was submitted")
        if problem:
            raise InvalidBatch(problem, line_errors=reader.errors)
    except BaseException:
        spool.close()
        raise
    spool.flush()
    return Spooled(reader.endpoint or "", reader.requests, name, spool)
