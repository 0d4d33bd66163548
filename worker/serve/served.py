"""ServedModels: what this worker serves, as the model registry knows it (protocol/registry.py).

At start the worker declares its model (DECLARE_MODEL): its id (the first `--served-model-name`, else the
checkpoint's short name), its names (the id, the `--model` value, the short name, every alias), its kind and
context length. The registry answers which model ids it serves (its own, and any model holding one of its
names with the same checkpoint), or refuses a name another checkpoint holds. Intake then reads those models'
queues, and the default queues while this worker serves the namespace's default model (re-read with every
heartbeat, so an operator's `tokenbus models default` moves the default queues' readers within a beat), and the
queues of the LoRA adapters it serves (worker/serve/adapters.py), each a model whose parent is its base.
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
                 aliases: list[str], context_length: int | None, kinds: list[str] | None = None,
                 root: str | None = None) -> None:
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
        kinds = [ModelKind(k) for k in kinds or [ModelKind.generate]]
        # `kind`: what it does first (a model that only embeds is "embed"); `kinds`: every kind it serves
        self.record = ModelRecord(id=names[0], names=names, kind=kinds[0], kinds=kinds, checkpoint=checkpoint,
                                  context_length=context_length, root=root, declared_at=time.time(),
                                  declared_by=worker)
        self.ids: list[str] = [self.record.id]  # the models whose queues it reads (after declare: the registry's)
        self.serves_default = False
        self.names = set(names)
        self.adapter_ids: list[str] = []  # the LoRA adapters it serves (worker/serve/adapters.py), swapped whole

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
        return [*self.ids, *self.adapter_ids, *([""] if self.serves_default else [])]

    def model_of_queue(self, queue: str) -> str | None:
        """The id of the model whose queue this is (`{ns}:m:{id}:...`: ids hold no ':'); None for the default
        queues. Read from the key, not the served list, so an adapter's job read just before its removal keeps
        its adapter (and fails model_not_found) instead of running on the base."""
        prefix = self.keys.prefix + ":m:"
        return queue[len(prefix):].split(":", 1)[0] if queue.startswith(prefix) else None

    def lora_of(self, model: str) -> str | None:
        """The engine's adapter name for a job of `model`: None for the base (or the default queues)."""
        return None if not model or model in self.ids else model

    def heartbeat_fields(self) -> dict[str, Any]:
        return {"model": self.id, "models": [*self.ids, *self.adapter_ids], "serves_default": self.serves_default,
                "kinds": [str(k) for k in self.record.kinds]}
