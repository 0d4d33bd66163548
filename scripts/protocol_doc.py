"""The Lua scripts' full texts in docs/protocol.md, generated from the code so the doc can never drift.

    .venv/bin/python scripts/protocol_doc.py          # rewrite the generated section of docs/protocol.md
    .venv/bin/python scripts/protocol_doc.py --check  # exit 1 if it differs (tests/protocol/test_protocol_doc.py)

The section lies between the BEGIN/END markers; everything else in the file is written by hand.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from protocol import scripts as shared  # noqa: E402
from worker.serve import queue_scripts  # noqa: E402

DOC = ROOT / "docs" / "protocol.md"
BEGIN = "<!-- BEGIN GENERATED SCRIPTS: scripts/protocol_doc.py writes this section; do not edit by hand -->"
END = "<!-- END GENERATED SCRIPTS -->"

# (name, who runs it, the Python text) in the order a job meets them
SCRIPTS: list[tuple[str, str, str]] = [
    ("SUBMIT_JOB", "client", shared.SUBMIT_JOB),
    ("QUEUE_DEPTH", "client", shared.QUEUE_DEPTH),
    ("READ", "worker", queue_scripts.READ),
    ("START_JOB", "worker", shared.START_JOB),
    ("FIRST_TOKEN", "worker", shared.FIRST_TOKEN),
    ("PUBLISH_TOKENS", "worker", queue_scripts.PUBLISH_TOKENS),
    ("RENEW", "worker", queue_scripts.RENEW),
    ("HAND_BACK", "worker", queue_scripts.HAND_BACK),
    ("FINISH_JOB", "worker", shared.FINISH_JOB),
    ("CANCEL_JOB", "client", shared.CANCEL_JOB),
    ("START_BATCH", "client", shared.START_BATCH),
    ("CANCEL_BATCH", "client", shared.CANCEL_BATCH),
    ("BUMP_BATCH", "client", shared.BUMP_BATCH),
]


def section() -> str:
    parts = [BEGIN, "", "Each block is the exact text to `EVAL` (or `SCRIPT LOAD` once, then `EVALSHA`; on `NOSCRIPT`,",
             "after a Redis restart, load it again). Its comments give KEYS and ARGV in order and what it returns.",
             ""]
    for name, who, text in SCRIPTS:
        parts += [f"### `{name}` ({who})", "", "```lua", text.strip("\n"), "```", ""]
    parts.append(END)
    return "\n".join(parts)


def render(doc: str) -> str:
    if BEGIN not in doc or END not in doc:
        raise SystemExit(f"{DOC}: the {BEGIN!r} and {END!r} markers are missing")
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return head + section() + tail


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="only compare; exit 1 when the doc is out of date")
    a = p.parse_args(argv)
    doc = DOC.read_text()
    new = render(doc)
    if a.check:
        if new != doc:
            print(f"{DOC} is out of date: run .venv/bin/python scripts/protocol_doc.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(new)
    print(f"wrote the script texts into {DOC}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
