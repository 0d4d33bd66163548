"""Where a benchmark's results go: a marked section of a file under docs/, rewritten in place (--no-write: only
printed)."""

from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = os.path.join(ROOT, "docs")


def write_section(filename: str, marker: str, body: str) -> str:
    """Replace the text between <!-- marker:start --> and <!-- marker:end --> in docs/filename."""
    path = os.path.join(DOCS, filename)
    text = open(path).read() if os.path.exists(path) else "# Benchmarks\n"
    block = f"<!-- {marker}:start -->\n{body.rstrip()}\n<!-- {marker}:end -->"
    pattern = re.compile(rf"<!-- {marker}:start -->.*?<!-- {marker}:end -->", re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    with open(path, "w") as f:
        f.write(text)
    return path


def publish(body: str, filename: str, marker: str, write: bool) -> None:
    """Print a benchmark's section and, with `write` (no --no-write), put it into docs/filename at `marker`."""
    print(body)
    if write:
        write_section(filename, marker, body)


