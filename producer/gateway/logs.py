"""structlog set-up for the gateway processes: key=value on a terminal, one JSON object per line otherwise."""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(level: str = "info", json: bool | None = None) -> None:
    if json is None:
        json = not sys.stderr.isatty()
    numeric = logging.getLevelNamesMapping()[level.upper()]
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, structlog.processors.add_log_level,
                    structlog.processors.TimeStamper(fmt="iso", utc=True), structlog.processors.format_exc_info,
                    renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    # uvicorn and RQ log through the standard library: the same stream and level.
    logging.basicConfig(level=numeric, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s %(message)s")
