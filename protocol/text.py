"""Storable text: what a request may make Redis hold is UTF-8, and what an error message copies of it is short.

JSON can spell a lone surrogate ("\\ud800") and Python's json accepts it, but no UTF-8 encoder does: such a
string reached Redis half-written (a batch created, then its listing 500 for good) or crashed a task at its
first write (issue #34). unstorable() finds the first such string of a parsed JSON value, key or value, so the
edge (the gateway's JSON bodies, a batch file's lines) can refuse it naming where it is. clip() bounds the copy
of a client's text that an error message (and so a stored batch record) holds.
"""

from __future__ import annotations

import re
from typing import Any

# What a lone surrogate can come from in a JSON text: a \uD800-\uDFFF escape, or its raw (CESU) UTF-8 bytes,
# which json.loads decodes with surrogatepass. A body without either holds none (the walk is then skipped).
SURROGATE_SOURCE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}|\xed[\xa0-\xbf]")
CLIP_CHARS = 80  # of a client's value quoted in an error message
MAX_MESSAGE_CHARS = 1000  # of one stored error message (a batch record holds MAX_ERRORS_SHOWN of them)


def _bad(s: str) -> bool:
    try:
        s.encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True


def printable(s: str) -> str:
    """s with any lone surrogate written as its escape: always encodable, for messages and logs."""
    return s.encode("utf-8", "backslashreplace").decode("utf-8")


def unstorable(value: Any, where: str = "") -> str | None:
    """The path (`metadata.tag`, `messages.0.content`) of the first string in a parsed JSON value that is not
    storable as UTF-8 (it holds a lone surrogate), or None. A bad object key is named by its parent."""
    stack: list[tuple[str, Any]] = [(where, value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            if _bad(v):
                return path or "the value"
        elif isinstance(v, dict):
            for k, item in v.items():
                if isinstance(k, str) and _bad(k):
                    return f"{path + ' ' if path else ''}(an object key)"
                stack.append((f"{path}.{k}" if path else str(k), item))
        elif isinstance(v, list):
            stack.extend((f"{path}.{i}" if path else str(i), item) for i, item in enumerate(v))
    return None


def surrogate_problem(raw: bytes, value: Any, where: str = "") -> tuple[str, str] | None:
    """(path, message) when the JSON text `raw`, parsed as `value`, holds a string that is not storable
    UTF-8; None otherwise (in one regex scan of `raw` when it holds no surrogate at all)."""
    if not SURROGATE_SOURCE.search(raw):
        return None
    path = unstorable(value, where)
    if path is None:
        return None
    return path, (f"{printable(path)}: holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not valid "
                  "Unicode text and cannot be stored; send the text as valid UTF-8 (a surrogate pair or the "
                  "character itself)")


def clip(s: str, limit: int = CLIP_CHARS) -> str:
    """repr of a client's value, cut to `limit` characters with its full length said: what an error message
    quotes of it (a 400 KB custom_id copied into every duplicate-id error filled Redis)."""
    if len(s) <= limit:
        return repr(printable(s))
    return f"{printable(s[:limit])!r}... ({len(s)} characters)"


def bounded(message: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """An error message as stored: at most `limit` characters (what it was cut from is said)."""
    if len(message) <= limit:
        return message
    return f"{message[:limit]}... (cut from {len(message)} characters)"
