"""The engine's error types: whose fault a failure is, and the protocol code the job fails with.

    EngineError ─┬─ InvalidRequest  the client's to fix: the job fails with `code` (invalid_request,
                 │                  grammar_too_costly) and the message says what to change
                 └─ EngineFault     the engine's own failure (a bug, a broken device, a caller's misuse):
                                    the job fails with worker_error, and the serve loop counts it against
                                    the engine, never against the request

`request_id` is set when the error belongs to one request's row of a step (raised before any sequence
changed): the serve loop then fails that job alone and the rest of the batch steps on. InvalidRequest is also a
ValueError, so offline callers that catch ValueError keep working; nothing in the serve loop catches ValueError.
"""

from __future__ import annotations

from protocol.errors import ErrorCode

# a request of a kind the model cannot serve: generation on an encoder (or a checkpoint without an LM head),
# embeddings on a model whose pooling tokenbus does not implement
UNSUPPORTED_KIND = ErrorCode.unsupported_kind.value


class EngineError(Exception):
    code: str = ErrorCode.worker_error.value

    def __init__(self, message: str, *, code: str | None = None, request_id: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        self.request_id = request_id


class InvalidRequest(EngineError, ValueError):
    """A request the engine refuses: an empty or out-of-vocabulary prompt, prompt + max_tokens past the model's
    context or the KV cache, a grammar it cannot compile or that costs too much CPU."""

    code = ErrorCode.invalid_request.value


class EngineFault(EngineError, RuntimeError):
    """The engine failed on its own: an unexpected exception inside it, or a caller's misuse (a request id
    already inside). Never the client's to fix."""

    code = ErrorCode.worker_error.value


def fault(err: BaseException, what: str, request_id: str | None = None) -> EngineError:
    """err as an EngineError: typed engine errors pass through, anything else becomes an EngineFault saying
    what the engine was doing."""
    if isinstance(err, EngineError):
        return err
    return EngineFault(f"{what}: {type(err).__name__}: {err}", request_id=request_id)
