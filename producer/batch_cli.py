"""`tokenbus batch submit|status|wait|retry|export|cancel`: the CLI's side of OpenAI Batch API JSONL files
(producer/batches.py does the work), with tqdm progress bars on stderr."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from producer import batch_retry, batches
from producer.client import Client
from protocol.priority import PRIORITIES, Priority


def add_parser(sub: Any) -> None:
    """`tokenbus batch ...` on the CLI's subparsers."""
    b = sub.add_parser("batch", help="OpenAI Batch API JSONL files").add_subparsers(dest="batch_command",
                                                                                     required=True)
    bs = b.add_parser("submit", help="validate a JSONL file and queue one job per line")
    bs.add_argument("file")
    bs.add_argument("--batch-id", help="your own id: re-running completes an interrupted submit")
    bs.add_argument("--model", help="replace each line's body.model ('' = drop it: the default model)")
    bs.add_argument("--wait", action="store_true", help="then wait with a progress bar")
    bs.add_argument("--priority", choices=[p.value for p in PRIORITIES], default=Priority.bulk.value,
                    help="of every job of the batch (default: bulk); batches of one priority take turns")
    for name in ("status", "wait", "cancel"):
        c = b.add_parser(name, help=f"batch {name}")
        c.add_argument("batch_id")
        if name == "wait":
            c.add_argument("--timeout", type=float)
    br = b.add_parser("retry", help="a new batch of the failed, cancelled and expired lines of an ended batch")
    br.add_argument("batch_id")
    br.add_argument("--file", help="the batch's input file, when it is no longer where it was submitted from")
    br.add_argument("--out", help="where the retried lines are written (default: <input>.retry-<id>.jsonl)")
    br.add_argument("--wait", action="store_true", help="then wait with a progress bar")
    be = b.add_parser("export", help="write OpenAI Batch output lines")
    be.add_argument("batch_id")
    be.add_argument("out")
    be.add_argument("--partial", action="store_true",
                    help="export a batch that has not ended (its ended jobs only)")
    be.add_argument("--drop-vectors", action="store_true",
                    help="an embedding batch: delete its vectors from Redis once the file is written")


def _batch_wait(c: Client, batch_id: str, timeout: float | None) -> int:
    from tqdm import tqdm

    bar = None

    def progress(rec: Any) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=rec.total, desc=batch_id, unit="job", file=sys.stderr)
        bar.set_postfix_str(f"{rec.status.value} failed={rec.failed} cancelled={rec.cancelled}",
                            refresh=False)
        bar.update(rec.done - bar.n)

    try:
        record = batches.wait_batch(c, batch_id, timeout=timeout, on_progress=progress)
    finally:
        if bar is not None:
            bar.close()
    print_json(record)
    return 0


class _Bars:
    """tqdm bars on stderr for a streaming submit or export, one per stage (shown only on a terminal)."""

    UNITS = {"validate": ("B", True), "enqueue": ("job", False), "export": ("job", False)}

    def __init__(self) -> None:
        self.bars: dict[str, Any] = {}

    def __call__(self, stage: str, done: int, total: int | None) -> None:
        from tqdm import tqdm

        bar = self.bars.get(stage)
        if bar is None:
            unit, scale = self.UNITS.get(stage, ("it", False))
            bar = self.bars[stage] = tqdm(total=total, desc=stage, unit=unit, unit_scale=scale, file=sys.stderr,
                                          disable=None)
        bar.update(done)

    def close(self) -> None:
        for bar in self.bars.values():
            bar.close()


def command(c: Client, a: argparse.Namespace) -> int:
    cmd = a.batch_command
    bars = _Bars()
    try:
        return _batch_command(c, a, cmd, bars)
    finally:
        bars.close()


def _batch_command(c: Client, a: argparse.Namespace, cmd: str, bars: _Bars) -> int:
    if cmd == "submit":
        record = batches.submit_batch(c, a.file, batch_id=a.batch_id, model=a.model, priority=a.priority,
                                      on_progress=bars)
        bars.close()
        print(record.id)
        return _batch_wait(c, record.id, None) if a.wait else 0
    if cmd == "status":
        print_json(batches.get_batch(c, a.batch_id))
    elif cmd == "wait":
        return _batch_wait(c, a.batch_id, a.timeout)
    elif cmd == "cancel":
        print_json(batches.cancel_batch(c, a.batch_id))
    elif cmd == "retry":
        record = batch_retry.retry_batch(c, a.batch_id, a.file, a.out)
        print(record.id)
        return _batch_wait(c, record.id, None) if a.wait else 0
    elif cmd == "export":
        n = batches.export_batch(c, a.batch_id, a.out, allow_partial=a.partial, on_progress=bars,
                                 drop_vectors=a.drop_vectors)
        bars.close()
        print(f"wrote {n} lines to {a.out}", file=sys.stderr)
    return 0


def print_json(model: Any) -> None:
    """A record as indented JSON on stdout (the CLI's output of every record)."""
    print(model.model_dump_json(indent=2))
