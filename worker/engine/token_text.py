"""Each token's own text and bytes, for results that carry logprobs (OpenAI's logprobs name every token by
its text and UTF-8 bytes; the producer has no tokenizer, so the worker writes them into the result)."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from typing import Any

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte fallback


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the printable character standing for each byte -> the byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def _kind(tokenizer: Any) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = type(getattr(backend, "decoder", None)).__name__
    pre = type(getattr(backend, "pre_tokenizer", None)).__name__
    return "byte_level" if "ByteLevel" in (decoder, pre) else "other"


def token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """The exact bytes one token stands for (part of a UTF-8 character for some tokens)."""
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if isinstance(piece, str):
        if _kind(tokenizer) == "byte_level":
            decoder = _byte_decoder()
            if all(c in decoder for c in piece):
                return bytes(decoder[c] for c in piece)
        if m := _BYTE_TOKEN.fullmatch(piece):
            return bytes([int(m.group(1), 16)])
        if "\u2581" in piece:  # SentencePiece's word-boundary marker is a space
            return piece.replace("\u2581", " ").encode()
    return tokenizer.decode([token_id], skip_special_tokens=False).encode()


def token_info(tokenizer: Any, ids: Iterable[int]) -> dict[str, dict[str, Any]]:
    """{"<id>": {"text": str, "bytes": [int, ...]}} for each id; text is the bytes decoded (U+FFFD where a
    token holds only part of a character)."""
    out: dict[str, dict[str, Any]] = {}
    for token_id in dict.fromkeys(ids):
        raw = token_bytes(tokenizer, token_id)
        out[str(token_id)] = {"text": raw.decode("utf-8", "replace"), "bytes": list(raw)}
    return out


def logprob_token_ids(logprobs: list[dict[int, float]] | None) -> list[int]:
    """Every token id named in a result's logprobs (sampled and top candidates), first seen first."""
    return list(dict.fromkeys(t for entry in logprobs or [] for t in entry))
