"""Batch lines ordered by prefix: a batch file's lines that start alike are enqueued together, so the worker
takes each group's lines one after another and its prefix cache holds one instruction at a time instead of
thrashing between several (and cascade decode attention finds whole groups running together).

Each line's key is a hash of how its prompt starts, computed as the spool pass streams the file
(producer/batch_spool.py): for prompt_token_ids the first PREFIX_TOKENS ids (a whole number of KV blocks of
16), for text prompts and chat messages the first PREFIX_CHARS characters of the text (roles included): the
producer has no tokenizer, and a few hundred characters are a few blocks of tokens. Groups are numbered in
order of their first line; pass 2 sends group by group, each group's lines in input order (a counting sort,
no line held in memory: 12 bytes a line of arrays, at most MAX_GROUPS keys).

The gateway's upload keys its lines the same way as they stream in and keeps the order beside the validated
requests (`save`: the two arrays, 12 bytes a line); its submit task loads it (`load`) and sends in this order
too. A kept order that does not fit its spool (another line count, offsets out of place) is not used: that
batch goes in input order, which is only slower.

What does not change: a batch's lines all go to its own stream, so fairness between batches and priorities
is what it was; job ids are still `{batch}-{input index}` and the batch's id list is in input order, so the
output file (export) stays in input order. (OpenAI's Batch API does not promise its output order; tokenbus
keeps the input's.)
"""

from __future__ import annotations

import hashlib
import os
from array import array
from collections.abc import Iterator
from pathlib import Path

import structlog

from protocol.models import JobRequest

PREFIX_CHARS = 512
PREFIX_TOKENS = 256
# distinct prefixes remembered; later new ones share one last group (input order). The dict of keys is the one
# part that grows with distinct lines (~150 bytes each): kept small, a file of unique prompts still costs memory
# flat in its size (tests/client/test_batch_memory.py); ordering pays for a few shared instructions, not 1,000s
MAX_GROUPS = 1024
MAGIC = b"tokenbus-prefix-order-1\n"  # a kept order's first bytes (save / load); native byte order

log = structlog.get_logger("tokenbus.producer")


def prefix_key(request: JobRequest) -> bytes:
    """The hash of how the request's prompt starts (module docstring)."""
    h = hashlib.blake2b(digest_size=8)
    if request.prompt_token_ids is not None:
        h.update(b"ids" + b"".join(t.to_bytes(4, "little") for t in request.prompt_token_ids[:PREFIX_TOKENS]))
    elif request.messages is not None:
        text, left = [], PREFIX_CHARS
        for m in request.messages:
            part = f"{m.role}\x1f{m.content}\x1e"[:left]
            text.append(part)
            left -= len(part)
            if left <= 0:
                break
        h.update(("chat" + "".join(text)).encode("utf-8", "surrogatepass"))
    else:
        h.update(("text" + (request.prompt or "")[:PREFIX_CHARS]).encode("utf-8", "surrogatepass"))
    return h.digest()


class PrefixOrder:
    """Each line's group, as the lines stream past, and the order that sends them group by group."""

    def __init__(self) -> None:
        self.groups: dict[bytes, int] = {}
        self.line_group = array("i")
        self.offsets = array("q")  # each line's first byte in the spool
        self._end = 0

    def add(self, request: JobRequest, line_bytes: int) -> None:
        """The next line: its request, and how many bytes its spool line takes."""
        self.offsets.append(self._end)
        self._end += line_bytes
        key = prefix_key(request)
        group = self.groups.get(key)
        if group is None:
            group = len(self.groups) if len(self.groups) < MAX_GROUPS else MAX_GROUPS
            if group < MAX_GROUPS:
                self.groups[key] = group
        self.line_group.append(group)

    @property
    def reorders(self) -> bool:
        """Whether grouping changes the input order (some group has lines apart from each other)."""
        return any(b < a for a, b in zip(self.line_group, self.line_group[1:], strict=False))

    def order(self) -> Iterator[int]:
        """Line indices, group by group (groups in order of their first line), each group in input order."""
        counts = array("q", bytes(8 * (MAX_GROUPS + 1)))
        for g in self.line_group:
            counts[g] += 1
        start, at = array("q", bytes(8 * (MAX_GROUPS + 1))), 0
        for g in range(MAX_GROUPS + 1):
            start[g], at = at, at + counts[g]
        order = array("q", bytes(8 * len(self.line_group)))
        for i, g in enumerate(self.line_group):
            order[start[g]] = i
            start[g] += 1
        return iter(order)

    def save(self, path: str | Path) -> None:
        """Keep the order in `path` (written whole, then moved into place): the line count, each line's group
        (int32) and its spool offset (int64)."""
        path = Path(path)
        part = path.with_name(f".{path.name}.part")
        with open(part, "wb") as f:
            f.write(MAGIC + len(self.line_group).to_bytes(8, "little"))
            self.line_group.tofile(f)
            self.offsets.tofile(f)
        os.replace(part, path)

    @classmethod
    def load(cls, path: str | Path, total: int, spool_bytes: int) -> PrefixOrder | None:
        """The order `save` kept in `path` for a spool of `total` lines and `spool_bytes` bytes; None where
        there is none or it does not fit that spool (the batch then goes in input order)."""
        path = Path(path)
        try:
            with open(path, "rb") as f:
                head = f.read(len(MAGIC) + 8)
                count = int.from_bytes(head[len(MAGIC):], "little")
                if head[: len(MAGIC)] != MAGIC or count != total:
                    raise ValueError(f"it holds {count} lines, its spool {total}" if head.startswith(MAGIC)
                                     else "not a kept prefix order")
                order = cls()
                order.line_group.fromfile(f, count)
                order.offsets.fromfile(f, count)
        except FileNotFoundError:
            return None
        except (OSError, EOFError, ValueError) as err:
            log.warning("prefix_order_unusable", path=str(path), error=str(err), effect="sent in input order")
            return None
        offsets = order.offsets
        fits = count == 0 or (offsets[0] == 0 and offsets[-1] < spool_bytes and all(
            a < b for a, b in zip(offsets, offsets[1:], strict=False)))
        if not fits or any(not 0 <= g <= MAX_GROUPS for g in order.line_group):
            log.warning("prefix_order_unusable", path=str(path), error="its offsets or groups do not fit its spool",
                        effect="sent in input order")
            return None
        order._end = spool_bytes
        return order
