"""Decides after each new token whether a sequence is done, and keeps its text when stop strings need it."""

from __future__ import annotations

from typing import Any

from worker.sequence import Sequence


class StopChecker:
    def __init__(self, tokenizer: Any, eos_token_ids: list[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len

    def check(self, seq: Sequence) -> str | None:
        """The finish reason ("stop" | "length") once seq's newest token ends it, else None."""
        params = seq.params
        token = seq.token_ids[-1]
        text_before = len(seq.output_text)
        if params.stop_strings:
            self._extend_text(seq)
        if seq.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                return "stop"
            if token in params.stop_token_ids:
                return "stop"
            if params.stop_strings and self._cut_at_stop_string(seq, text_before):
                return "stop"
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def final_text(self, seq: Sequence) -> str:
        if seq.params.stop_strings:
            return seq.output_text
        return self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=seq.params.skip_special_tokens)

    def _extend_text(self, seq: Sequence) -> None:
        # Decode a short window and keep only what it adds, so a multi-token character is never split.
        skip = seq.params.skip_special_tokens
        before = self.tokenizer.decode(seq.token_ids[seq.prefix_offset : seq.read_offset], skip_special_tokens=skip)
        after = self.tokenizer.decode(seq.token_ids[seq.prefix_offset :], skip_special_tokens=skip)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            seq.output_text += after[len(before) :]
            seq.prefix_offset = seq.read_offset
            seq.read_offset = seq.num_tokens

    def _cut_at_stop_string(self, seq: Sequence, text_before: int) -> bool:
        text = seq.output_text
        longest = max(len(s) for s in seq.params.stop_strings)
        # a stop string completed by this token ends in the new text, so it starts at most this far back
        window_start = max(0, text_before - longest + 1)
        hits = [i for s in seq.params.stop_strings if (i := text.find(s, window_start)) != -1]
        if not hits:
            return False
        seq.output_text = text[: min(hits)]
        return True
