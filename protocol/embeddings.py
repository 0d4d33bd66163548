"""Embedding jobs in the protocol: the input rules, the limits, and how the vectors are stored (no torch, no numpy).

A job is an embedding job when its request has `input` (OpenAI's embeddings API): a string, a list of strings,
a list of token ids, or a list of such lists. Its result (protocol.jobs.JobResult) says how many vectors, their
width and dtype, and usage.prompt_tokens; the vectors themselves are one Redis string beside the record,
`{ns}:job:{id}:vectors`: every vector's little-endian float32 (or float16, `embedding_dtype`) bytes, one after
the other in input order. A 384-wide float32 vector is 1,536 bytes there, against ~8 KB as JSON text.
"""

from __future__ import annotations

import base64
import struct
from typing import Any, Literal

# OpenAI's limit per embeddings request; a batch line is one request, so a larger corpus is many lines
MAX_EMBED_INPUTS = 2048
EMBED_DTYPES: dict[str, str] = {"float32": "f", "float16": "e"}  # embedding_dtype -> struct format letter
EmbedDtype = Literal["float32", "float16"]
EncodingFormat = Literal["float", "base64"]
# generation fields that mean nothing to an embedding job (refused, so a mixed-up request fails at submit)
EMBED_FIELDS = ("input", "encoding_format", "dimensions", "truncate", "embedding_dtype")


def as_inputs(value: Any) -> list[Any]:
    """The inputs of an embedding request as a list (one entry per vector), nothing else checked: for a request
    validated already (JobRequest checks its `input` once, with check_input). ValueError if `value` is not a
    string or a list.

    A list of ints is ONE input of token ids (as OpenAI reads it); a list of lists is several."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        if value and type(value[0]) is not str and all(_is_int(v) for v in value):
            return [value]  # one input of token ids
        return value
    raise ValueError("input is a string, a list of strings, a list of token ids or a list of such lists")


def check_input(value: Any) -> list[str] | list[list[int]]:
    """The inputs of an embedding request as a list (as_inputs), or ValueError saying what is wrong."""
    inputs = as_inputs(value)
    if not inputs:
        raise ValueError("input must not be an empty list")
    if len(inputs) > MAX_EMBED_INPUTS:
        raise ValueError(f"input has {len(inputs)} entries; at most {MAX_EMBED_INPUTS} a request (split them over "
                         "several requests or batch lines)")
    kinds = {type(x) is str for x in inputs}
    if len(kinds) > 1:
        raise ValueError("input mixes strings and token-id lists; send one kind per request")
    for i, item in enumerate(inputs):
        where = f"input[{i}]" if len(inputs) > 1 else "input"
        if isinstance(item, str):
            if not item:
                raise ValueError(f"{where} is an empty string")
        elif isinstance(item, list):
            if not item:
                raise ValueError(f"{where} is an empty list of token ids")
            if not all(_is_int(t) for t in item):
                raise ValueError(f"{where} holds something other than token ids (integers)")
            if min(item) < 0 or max(item) > 2**31 - 1:
                raise ValueError(f"{where}: token ids must be >= 0 (and below the model's vocabulary size)")
        else:
            raise ValueError(f"{where} is a {type(item).__name__}; each input is a string or a list of token ids")
    return inputs


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def pack_vectors(vectors: list[list[float]] | list[Any], dtype: str = "float32") -> bytes:
    """Vectors (lists of floats, or anything with .tolist()) as their little-endian bytes, in order."""
    letter = EMBED_DTYPES[dtype]
    parts = []
    for v in vectors:
        values = v.tolist() if hasattr(v, "tolist") else v
        parts.append(struct.pack(f"<{len(values)}{letter}", *values))
    return b"".join(parts)


def vector_bytes(dim: int, dtype: str) -> int:
    return dim * struct.calcsize(EMBED_DTYPES[dtype])


def unpack_vector(blob: bytes | memoryview, index: int, dim: int, dtype: str) -> list[float]:
    """Vector `index` of a job's vectors blob as floats."""
    size = vector_bytes(dim, dtype)
    chunk = blob[index * size:(index + 1) * size]
    if len(chunk) != size:
        raise ValueError(f"the vectors blob holds {len(blob)} bytes; vector {index} of width {dim} ({dtype}) "
                         "is past its end (the record expired, or was written by another release?)")
    return list(struct.unpack(f"<{dim}{EMBED_DTYPES[dtype]}", chunk))


def encode_vector(blob: bytes | memoryview, index: int, dim: int, dtype: str, encoding_format: str) -> Any:
    """Vector `index` in OpenAI's `embedding` field: a list of floats, or base64 of its little-endian float32."""
    if encoding_format != "base64":
        return unpack_vector(blob, index, dim, dtype)
    if dtype == "float32":  # the stored bytes are the answer: no float is decoded
        size = vector_bytes(dim, dtype)
        return base64.b64encode(bytes(blob[index * size:(index + 1) * size])).decode()
    return base64.b64encode(struct.pack(f"<{dim}f", *unpack_vector(blob, index, dim, dtype))).decode()
