"""tokenbus-gateway: an OpenAI-compatible HTTP API (files, batches, chat/completions) in front of the queue.

Imports no torch. `create_app` builds the ASGI app; `python -m gateway [serve|tasks]` runs it.
See docs/gateway.md.
"""

from __future__ import annotations

from typing import Any


def create_app(*args: Any, **kwargs: Any) -> Any:
    from gateway.app import create_app as _create

    return _create(*args, **kwargs)


__all__ = ["create_app"]
