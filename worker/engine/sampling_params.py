"""SamplingParams: what a request asks of generation.

The fields, their defaults and their checks are the wire protocol's `GenerationParams` (protocol/models.py,
their one definition); this subclass adds only what the engine derives from them. A job's generation fields
become SamplingParams unchanged, and a bad value fails with the same message on both sides.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

from pydantic import ValidationError

from protocol.models import GenerationParams, describe_validation_error
from worker.engine.errors import InvalidRequest


class SamplingParams(GenerationParams):
    @cached_property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @cached_property
    def stop_hold(self) -> int:
        """Characters of the output held back while a stop string could still begin in them."""
        return max((len(s) for s in self.stop_strings), default=1) - 1

    @cached_property
    def stop_ids(self) -> frozenset[int]:
        return frozenset(self.stop_token_ids or ())

    @cached_property
    def grammar(self) -> str | None:
        """The llguidance grammar of response_format / regex / choice; None for an unconstrained request."""
        return self.constraint_grammar()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @classmethod
    def field_names(cls) -> list[str]:
        return list(cls.model_fields)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SamplingParams:
        """SamplingParams from plain values, or InvalidRequest naming every bad or unknown field."""
        unknown = sorted(set(values) - set(cls.model_fields))
        if unknown:
            raise InvalidRequest(f"unknown sampling parameter(s) {unknown}; known ones are {cls.field_names()}")
        try:
            return cls.model_validate(values)
        except ValidationError as err:
            raise InvalidRequest(f"invalid sampling parameters: {describe_validation_error(err)}") from None

    @classmethod
    def of(cls, request: GenerationParams) -> SamplingParams:
        """The generation fields of a request that was validated already (a job's JobRequest): taken as they
        are, not checked a second time."""
        return cls.model_construct(**request.sampling_fields())

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump()
