"""A request's input as token ids: text (tokenized), token ids (checked against the vocabulary) or, for
generation, chat messages (the model's chat template). The checks both generation and embedding inputs share."""

from __future__ import annotations

from typing import Any

from worker.engine.errors import InvalidRequest


def is_token_ids(prompt: Any) -> bool:
    return isinstance(prompt, list | tuple) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)


def check_token_ids(ids: list[int] | tuple[int, ...], vocab_size: int, what: str = "prompt") -> list[int]:
    """ids as a list, or InvalidRequest when there are none or some fall outside [0, vocab_size)."""
    if not ids:
        raise InvalidRequest(f"the {what} is an empty list of token ids")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest(f"{what} token ids out of the vocabulary [0, {vocab_size}): {bad[:5]}")
    return list(ids)


def tokenize(tokenizer: Any, vocab_size: int, prompt: Any) -> list[int]:
    """A generation prompt's token ids."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequest("the prompt is empty")
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
        for m in prompt:
            if "role" not in m or "content" not in m:
                raise InvalidRequest(f"each chat message needs 'role' and 'content', got {m!r}")
        ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)
    if is_token_ids(prompt):
        return check_token_ids(prompt, vocab_size)
    raise InvalidRequest("a prompt is a non-empty string, a list of token ids, or a list of chat messages")
