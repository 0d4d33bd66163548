"""Errors: the codes a failed job's record carries (every process reads them), and the exceptions the producer
side raises. Every message says what was wrong and what to do about it."""

from __future__ import annotations

from enum import StrEnum

MAX_ERRORS_SHOWN = 20


class ErrorCode(StrEnum):
    """`error_code` values in a job record; workers may add others (clients must accept any string)."""

    invalid_request = "invalid_request"  # failed the worker's re-validation or the engine's checks
    model_mismatch = "model_mismatch"  # request.model is not the worker's model
    worker_error = "worker_error"  # an exception while generating
    max_attempts = "max_attempts"  # reclaimed too often (worker crashes); also dead-lettered
    cancelled = "cancelled"
    grammar_too_costly = "grammar_too_costly"  # one mask of its constraint took over mask_budget_ms of CPU
    model_not_found = "model_not_found"  # names a model the namespace has not declared (refused at submit)
    unsupported_kind = "unsupported_kind"  # a job kind its model cannot serve (generation on an encoder, ...)


def listing(problems: list[str]) -> str:
    """The first MAX_ERRORS_SHOWN problems, one per indented line, and how many more there are."""
    shown = "\n  ".join(problems[:MAX_ERRORS_SHOWN])
    more = len(problems) - MAX_ERRORS_SHOWN
    return f"\n  {shown}" + (f"\n  ... and {more} more" if more > 0 else "")


class TokenbusError(Exception):
    """Base class: the CLI prints these as one line and exits non-zero."""


class InvalidJob(TokenbusError, ValueError):
    """A job request that does not follow the protocol (unknown field, bad value, no/two prompts)."""


class InvalidBatch(InvalidJob):
    """A batch input file with bad lines; `.line_errors` holds (line number, message) for each."""

    def __init__(self, message: str, line_errors: list[tuple[int, str]] | None = None) -> None:
        super().__init__(message)
        self.line_errors = line_errors or []


class QueueFull(TokenbusError):
    """The jobs stream holds max_queue_len entries; `.accepted` lists ids already queued by this call."""

    def __init__(self, message: str, accepted: list[str] | None = None) -> None:
        super().__init__(message)
        self.accepted = accepted or []


class ModelNotFound(InvalidJob, LookupError):
    """A job names a model that no worker or operator declared in the namespace; `.declared` lists those that
    are (docs/protocol.md, "Models"). Nothing of the call was queued."""

    def __init__(self, model: str, declared: list[str], namespace: str = "") -> None:
        self.model = model
        self.declared = sorted(declared)
        where = f" in namespace {namespace!r}" if namespace else ""
        shown = ", ".join(repr(m) for m in self.declared) or "none yet"
        super().__init__(f"model {model!r} is not declared{where}; declared models: {shown}. Name one of them, "
                         "start a worker that serves it, or declare it (tokenbus models add NAME)")


class JobNotFound(TokenbusError, KeyError):
    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "job not found"


class BatchNotFound(JobNotFound):
    pass


class WaitTimeout(TokenbusError, TimeoutError):
    """wait/as_completed ran out of time; `.pending` lists the ids that had not ended."""

    def __init__(self, message: str, pending: list[str] | None = None) -> None:
        super().__init__(message)
        self.pending = pending or []
