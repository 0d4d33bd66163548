"""Decides after each new token whether a sequence is done: EOS, stop token ids, stop strings (in the
detokenizer's text), min_tokens, and the length rule (Sequence.max_num_tokens)."""

from __future__ import annotations

from functools import lru_cache

import ahocorasick

from worker.engine.sequence import Sequence


@lru_cache(maxsize=1024)  # a batch's lines share one stop list: built once, not once per job
def stop_automaton(stop_strings: tuple[str, ...]) -> ahocorasick.Automaton:
    """One Aho-Corasick automaton over a request's stop strings: a scan of the text's tail finds every one of
    them in one pass, whatever their number (a value is its string's length)."""
    automaton = ahocorasick.Automaton()
    for s in stop_strings:
        automaton.add_word(s, len(s))
    automaton.make_automaton()
    return automaton


class StopChecker:
    def __init__(self, eos_token_ids: list[int]) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)

    def check(self, seq: Sequence, new_text_from: int) -> str | None:
        """The finish reason ("stop" | "length") once seq's newest token ends it, else None. new_text_from is
        where this token's text starts in seq.output_text."""
        params = seq.params
        token_ids = seq.token_ids
        token = token_ids[-1]
        num_output = len(token_ids) - len(seq.prompt_token_ids)
        if num_output >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                return "stop"
            if token in params.stop_ids:
                return "stop"
            if params.stop_strings and self._cut_at_stop_string(seq, new_text_from):
                return "stop"
        if len(token_ids) >= seq.max_num_tokens:
            return "length"
        return None

    @staticmethod
    def finds_stop_string(seq: Sequence, new_text_from: int) -> bool:
        """Whether a stop string ends in the text from new_text_from on (check() then cuts the text there)."""
        return bool(StopChecker._stop_hits(seq.text, seq, new_text_from))

    @staticmethod
    def _stop_hits(text: str, seq: Sequence, new_text_from: int) -> list[int]:
        """Where each stop string found in text starts: one completed by this token ends in the new text, so it
        starts at most stop_hold characters before it."""
        window_start = max(0, new_text_from - seq.params.stop_hold)
        if window_start >= len(text):
            return []
        automaton = stop_automaton(seq.params.stop_strings)
        return [end - length + 1 for end, length in automaton.iter(text, window_start)]

    @staticmethod
    def _cut_at_stop_string(seq: Sequence, new_text_from: int) -> bool:
        text = seq.output_text
        hits = StopChecker._stop_hits(text, seq, new_text_from)
        if not hits:
            return False
        seq.text = text[: min(hits)]
        return True
