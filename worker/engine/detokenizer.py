"""IncrementalDetokenizer: one sequence's output text, grown one token at a time.

It is the only place output tokens become text: stop strings are looked for in it, streaming publishes it,
and the final result is the same text, so a streamed job's chunks always join to its result. Fast
tokenizers use `tokenizers`' DecodeStream (a few microseconds a token); others decode the window of tokens since
the last text and keep what the new token adds. Either way a character split across tokens appears once
its last byte has arrived.
"""

from __future__ import annotations

from typing import Any

from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._fast = getattr(tokenizer, "backend_tokenizer", None)
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens) if self._fast is not None else None
        # slow tokenizers: the output so far and the offsets of the window already turned into text
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def feed(self, token_ids: list[int]) -> str:
        """The text these tokens complete: what step() on each in turn would return, joined."""
        if self._stream is not None:
            return self._stream.step(self._fast, token_ids) or ""
        return "".join([self.step(t) for t in token_ids])

    def step(self, token_id: int) -> str:
        """The text this token completes ("" while a multi-byte character is still incomplete)."""
        if self._stream is not None:
            return self._stream.step(self._fast, token_id) or ""
        self._ids.append(token_id)
        decode = self.tokenizer.decode
        before = decode(self._ids[self._prefix_offset : self._read_offset],
                        skip_special_tokens=self.skip_special_tokens)
        after = decode(self._ids[self._prefix_offset :], skip_special_tokens=self.skip_special_tokens)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return after[len(before) :]
