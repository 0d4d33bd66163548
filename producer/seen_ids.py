"""The custom_ids of a batch file seen so far, in about 12 bytes each: a million-line file is checked for a
repeated custom_id in ~25 MB, where a dict of the strings took ~100 MB (and the reader must stay flat in the
file's size: docs/bench_million.md).

An open-addressing table of 64-bit fingerprints (Python's hash of the string) beside the line number of each,
in two stdlib arrays. Two different custom_ids share a fingerprint with odds of about n^2 / 2^65 (3e-8 for a
million lines); the string hash is salted per process, so such a file passes when checked again.
"""

from __future__ import annotations

from array import array

_MASK = (1 << 64) - 1


class SeenIds:
    def __init__(self, capacity: int = 1 << 12) -> None:
        self._new(capacity)
        self.count = 0

    def _new(self, capacity: int) -> None:
        self._cap = capacity
        self._fp = array("Q", bytes(8 * capacity))  # 0 = empty slot (a fingerprint is never 0)
        self._line = array("I", bytes(4 * capacity))  # line numbers up to 4e9

    def add(self, value: str, line: int) -> int | None:
        """Remember `value` seen on `line`; the line it was seen on before, or None the first time."""
        fp = (hash(value) & _MASK) | 1
        mask = self._cap - 1
        i = fp & mask
        fps = self._fp
        while True:
            slot = fps[i]
            if slot == 0:
                break
            if slot == fp:
                return self._line[i]
            i = (i + 1) & mask
        fps[i] = fp
        self._line[i] = line
        self.count += 1
        if self.count * 2 > self._cap:  # at most half full: probes stay short
            self._grow()
        return None

    def _grow(self) -> None:
        old_fp, old_line = self._fp, self._line
        self._new(self._cap * 2)
        mask = self._cap - 1
        fps, lines = self._fp, self._line
        for fp, line in zip(old_fp, old_line, strict=True):
            if fp:
                i = fp & mask
                while fps[i]:
                    i = (i + 1) & mask
                fps[i] = fp
                lines[i] = line

    @property
    def nbytes(self) -> int:
        return self._cap * (self._fp.itemsize + self._line.itemsize)
