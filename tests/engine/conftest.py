"""Fixtures the engine tests share: SmolLM2's Hugging Face reference, computed once per prompt for the session."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.support.hf_reference import hf_greedy, load_hf


class GreedyReference:
    """HF `generate` (greedy, fp32) on one checkpoint, each (prompt ids, max_tokens, ignore_eos) computed once a
    session: several modules check prompts behind the same ~370-token system prompt (a 2.5 CPU-s prefill each),
    and pytest-xdist may run them in different processes, so each answer is also left in a folder all of the
    session's processes share. The model loads on first use."""

    def __init__(self, directory: str, memo: Path) -> None:
        self.directory, self.memo, self._model = directory, memo, None
        memo.mkdir(parents=True, exist_ok=True)

    @property
    def model(self) -> Any:
        if self._model is None:
            self._model = load_hf(self.directory)
        return self._model

    def greedy(self, ids: list[int], max_tokens: int, ignore_eos: bool = False) -> list[int]:
        key = json.dumps([list(ids), max_tokens, ignore_eos])
        path = self.memo / (hashlib.sha256(key.encode()).hexdigest()[:32] + ".json")
        if path.exists():
            stored = json.loads(path.read_text())
            if stored["key"] == key:
                return stored["tokens"]
        tokens = hf_greedy(self.model, list(ids), max_tokens, ignore_eos=ignore_eos)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, "tokens": tokens}))
        tmp.replace(path)  # whole or absent: another process may read it at any moment
        return tokens


@pytest.fixture(scope="session")
def smollm2_reference(tmp_path_factory) -> GreedyReference:
    """SmolLM2-135M loaded by transformers straight from its source directory (independent of the engine's
    converted checkpoint); under xdist the memo folder sits beside the workers' own temp folders."""
    from worker.engine.loader import resolve

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    return GreedyReference(resolve("smollm2-135m").directory, shared / "hf-smollm2-reference")
