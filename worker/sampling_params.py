"""What a request asks of generation. The job protocol (producer/protocol.py) mirrors these field names."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    max_tokens: int = 256
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        problems = []
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            problems.append(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            problems.append(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        elif isinstance(self.max_tokens, int) and self.min_tokens > self.max_tokens:
            problems.append(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.temperature < 0:
            problems.append(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            problems.append(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not 0 <= self.min_p <= 1:
            problems.append(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            problems.append(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                problems.append(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            problems.append(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.seed is not None and not isinstance(self.seed, int):
            problems.append(f"seed must be an integer, got {self.seed!r}")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stops):
            problems.append(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        if problems:
            raise ValueError("invalid sampling parameters: " + "; ".join(problems))
        self.stop_strings = stops
        self.stop_token_ids = list(self.stop_token_ids or [])

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls) if f.init]

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SamplingParams:
        unknown = sorted(set(values) - set(cls.field_names()))
        if unknown:
            raise ValueError(
                f"unknown sampling parameter(s) {unknown}; known ones are {cls.field_names()}"
            )
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("stop_strings")
        return out
