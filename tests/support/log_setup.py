"""structlog in the test processes: its defaults (key=value lines on stdout, every level), except tracebacks.

Unconfigured, structlog renders an exception with rich, its locals included; an intake thread's locals hold
whole read batches (1 MiB prompts, 100,000 brackets: tests/serve/test_serve_hostile.py), and one such
`log.exception` took 38 s to render on a loaded machine. The worker's own processes never render this way
(protocol/logs.py formats exceptions as plain text first), so the tests lose nothing by the plain traceback."""

from __future__ import annotations

import structlog


def plain_tracebacks() -> None:
    """structlog's default configuration with a plain traceback (call again after a test reconfigures it)."""
    structlog.reset_defaults()
    processors = structlog.get_config()["processors"]
    renderer = structlog.dev.ConsoleRenderer(exception_formatter=structlog.dev.plain_traceback)
    structlog.configure(processors=[*processors[:-1], renderer])
