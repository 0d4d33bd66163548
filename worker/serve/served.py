"""ServedModels: what this worker serves, as the model registry knows it (protocol/registry.py).

At start the worker declares its model (DECLARE_MODEL): its id (the first `--served-model-name`, else the
checkpoint's short name), its names (the id, the `--model` value, the short name, every alias), its kind and
context length. The registry answers which model ids it serves (its own, and any model holding one of its
names with the same checkpoint), or refuses a name another checkpoint holds. Intake then reads those models'
queues, and the default queues while this worker serves the namespace's default model (re-read with every
heartbeat, so an operator's `tokenbus models default` moves the default queues' readers within a beat).
"""

from __future__ import annotations

import time
from typing import Any

import structlog

from protocol import scripts
from protocol.keys import Keys
from protocol.registry import DEFAULT_MODEL_FIELD, ModelKind, ModelRecord, model_name_problem

log = structlog.get_logger("tokenbus.worker")


class ServedModels:
    def __init__(self, keys: Keys, worker: str, model_arg: str, short_name: str, checkpoint: str,
                 aliases: list[str], context_length: int | None, kind: ModelKind = ModelKind.generate) -> None:
        self.keys = keys
        candidates = [*aliases, short_name, model_arg]
        names = []
        for name in dict.fromkeys(candidates):
            problem = model_name_problem(name)
            if problem is None:
                names.append(name)
            elif name in aliases or name == short_name:
                raise ValueError(f"--served-model-name / model name {name!r} cannot name a model: {problem}")
            else:  # a path with ':' or a long one: jobs name the model by its other names
                log.info("model_name_skipped", name=name[:210], reason=problem)
        self.record = ModelRecord(id=names[0], names=names, kind=kind, checkpoint=checkpoint,
                                  context_length=context_length, declared_at=time.time(), declared_by=worker)
        self.ids: list[str] = [self.record.id]  # the models whose queues it reads (after declare: the registry's)
        self.serves_default = False
        self.names = set(names)

    @property
    def id(self) -> str:
        """The model this worker serves (its results' `model`)."""
        return self.ids[0]

    def declare(self, r: Any) -> None:
        """DECLARE_MODEL; TokenbusError (naming both checkpoints) when a name is another checkpoint's."""
        self.ids = scripts.declare_model(r, self.keys, self.record)
        self.names |= set(self.ids)
        self.refresh_default(r)
        log.info("model_declared", model=self.id, serves=self.ids, names=sorted(self.names),
                 checkpoint=self.record.checkpoint, default=self.serves_default)

    def refresh_default(self, r: Any) -> bool:
        """Re-read the namespace's default model; True when whether this worker serves it changed."""
        default = r.hget(self.keys.config, DEFAULT_MODEL_FIELD)
        serves = default is not None and (default.decode() if isinstance(default, bytes) else default) in self.ids
        changed, self.serves_default = serves != self.serves_default, serves
        return changed

    def read_ids(self) -> list[str]:
        """The READ script's model ids: its models, then '' (the default queues) while it serves the default."""
        return [*self.ids, *([""] if self.serves_default else [])]

    def model_of_queue(self, queue: str) -> str | None:
        """The id of the served model whose queue this is; None for the default queues."""
        for mid in self.ids:
            if queue.startswith(self.keys.for_model(mid).queue_prefix + ":"):
                return mid
        return None

    def heartbeat_fields(self) -> dict[str, Any]:
        return {"model": self.id, "models": list(self.ids), "serves_default": self.serves_default}
