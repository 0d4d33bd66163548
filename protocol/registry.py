"""The model registry of a namespace: which models are declared, by which names, and what each one is.

Part of the wire protocol (docs/protocol.md, "Models"). `{ns}:models` maps a model's id to its ModelRecord (JSON),
`{ns}:model-names` maps every name a job may give (the id, the `--model` value, the checkpoint's short name,
`--served-model-name` aliases) to the id, and `{ns}:config` `default_model` names the default model. A job
that names a model waits on that model's queues (`{ns}:m:{id}:q:...`, protocol/keys.py); one that names none
waits on the default queues (`{ns}:q:...`), which the default model's workers read.
"""

from __future__ import annotations

import functools
import json
import unicodedata
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, field_validator

from protocol.errors import InvalidJob

MAX_MODEL_NAME_BYTES = 200
DEFAULT_MODEL_FIELD = "default_model"  # the field of {ns}:config naming the default model


class ModelKind(StrEnum):
    """What a model's workers do with a job. A LoRA adapter is a model of its base's kind with a `parent` (the
    base's id): it needs no kind of its own."""

    generate = "generate"
    embed = "embed"


def model_name_problem(name: object) -> str | None:
    """Why `name` cannot name a model (it becomes a part of Redis keys), or None when it can."""
    if not isinstance(name, str) or not name:
        return "a model name must be a non-empty string"
    return _name_problem(name)


@functools.lru_cache(maxsize=1024)
def _name_problem(name: str) -> str | None:
    # cached: every line of a batch file names its model, and the per-character scan was ~15% of validating one
    if len(name.encode("utf-8", "surrogatepass")) > MAX_MODEL_NAME_BYTES:
        return f"a model name is at most {MAX_MODEL_NAME_BYTES} bytes of UTF-8"
    if ":" in name or "{" in name or "}" in name:
        return "a model name holds no ':' (the separator of key parts) and no '{' or '}' (the hash tag's braces)"
    if any(unicodedata.category(ch) in ("Cc", "Cs") for ch in name):
        return "a model name holds no control characters"
    return None


def check_model_name(name: str, what: str = "model") -> str:
    """`name` if it can name a model, else InvalidJob saying why and what to do."""
    problem = model_name_problem(name)
    if problem:
        shown = repr(name)[:80] if isinstance(name, str) else type(name).__name__
        raise InvalidJob(f"invalid {what} name {shown}: {problem}; name the model as the gateway's /v1/models "
                         "or `tokenbus models list` shows it")
    return name


def short_name(model: str) -> str:
    """A checkpoint's short name: a path's or hub id's last part, without `.gguf` (`smollm2-135m` as is)."""
    last = model.rstrip("/\\").replace("\\", "/").rsplit("/", 1)[-1] or model
    return last.removesuffix(".gguf")


class ModelRecord(BaseModel):
    """The JSON value of `{ns}:models` field <id>."""

    model_config = ConfigDict(extra="ignore")

    id: str
    names: list[str] = Field(default_factory=list)  # every name that routes to it, the id first
    kind: ModelKind = ModelKind.generate
    kinds: list[ModelKind] = Field(default_factory=list)  # every job kind it serves ([] from older releases: kind)
    checkpoint: str = ""  # "<short name>#<config fingerprint>" of the weights ('' = declared by hand, none yet)
    context_length: int | None = None
    parent: str | None = None  # a LoRA adapter's base model (its id); None for a base model
    root: str | None = None  # where its weights come from, as its first declarer loaded them: the worker's --model
    # value, an adapter's directory (vLLM's model card field of the same name)
    declared_at: float | None = None
    declared_by: str = ""  # the worker that declared it first, or "operator"

    @field_validator("kinds", "names", mode="before")
    @classmethod
    def _empty_list(cls, v: object) -> object:
        return [] if v == {} else v  # Redis's cjson encodes an empty list as {} (DECLARE_MODEL re-encodes records)

    def served_kinds(self) -> list[str]:
        """The job kinds its workers serve (a record written before kinds: its one kind)."""
        return [str(k) for k in self.kinds] or [str(self.kind)]

    def to_json(self) -> str:
        return self.model_dump_json(exclude_none=True)

    @classmethod
    def from_json(cls, raw: str) -> ModelRecord:
        return cls.model_validate(json.loads(raw))
