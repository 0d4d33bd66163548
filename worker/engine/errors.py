"""The engine's own error type for a request it can never serve as given.

InvalidRequest is the client's to fix (the serve loop fails the job with `invalid_request` and says why);
any other exception out of the engine is the worker's fault (`worker_error`). It is a ValueError, so offline
callers that catch ValueError keep working."""

from __future__ import annotations


class InvalidRequest(ValueError):
    """A request the engine refuses: an empty or out-of-vocabulary prompt, prompt + max_tokens past the model's
    context or the KV cache, a grammar it cannot compile."""
