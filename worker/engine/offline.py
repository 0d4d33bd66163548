"""Offline runs (Engine.generate, Engine.embed): every input added, steps until each has ended, the outputs in
input order. A refusal at add leaves nothing of the call behind; a request the engine rejected mid-run
(a grammar it could not compile) is raised once the others have ended."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any, Protocol

from worker.engine.errors import EngineError, EngineFault, InvalidRequest
from worker.engine.outputs import RequestOutput


class OfflineEngine(Protocol):
    """What an offline run needs of the Engine (a Protocol: engine.py imports this module)."""

    steps: int
    rejected: dict[str, EngineError]

    def add_request(self, request_id: str, prompt: Any, params: Any = None, priority: Any = 0,
                    lora: str | None = None) -> None: ...
    def abort(self, request_id: str) -> RequestOutput | None: ...
    def step(self) -> list[RequestOutput]: ...


def run(engine: OfflineEngine, kind: str, prompts: Seq[Any], params_list: list[Any],
        loras: list[str | None] | None = None) -> list[RequestOutput]:
    ids = [f"{kind}-{engine.steps}-{i}" for i in range(len(prompts))]
    added: list[str] = []
    for rid, prompt, p, lora in zip(ids, prompts, params_list, loras or [None] * len(ids), strict=True):
        try:
            engine.add_request(rid, prompt, p, lora=lora)
        except EngineError as err:  # nothing of this call stays behind in the engine
            for other in added:
                engine.abort(other)
            raise type(err)(f"{kind} input {len(added)}: {err}", code=err.code) from err
        added.append(rid)
    results: dict[str, RequestOutput] = {}
    rejected: dict[str, EngineError] = {}
    while len(results) + len(rejected) < len(ids):
        for out in engine.step():
            results[out.request_id] = out
        rejected.update(engine.rejected)
    if rejected:
        why = "; ".join(f"prompt {ids.index(rid)}: {err}" for rid, err in rejected.items())
        errors = list(rejected.values())
        if all(isinstance(err, InvalidRequest) for err in errors):
            raise InvalidRequest(why, code=errors[0].code)
        raise EngineFault(why)
    return [results[rid] for rid in ids]
