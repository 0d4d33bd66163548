"""structlog set-up for every tokenbus process (worker, gateway, its tasks): key=value lines on a terminal, one JSON
object per line otherwise (log shippers)."""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(level: str = "info", json: bool | None = None, libraries: str = "warning") -> None:
    """libraries: the least level of stdlib-logging libraries shown (uvicorn and RQ: "info"; transformers: not)."""
    if json is None:
        json = not sys.stderr.isatty()
    numeric = logging.getLevelNamesMapping()[level.upper()]
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),  # line and newline in one write:
        # a print() writes them apart, and a TP rank sharing the stream then glued its line onto the other's
        cache_logger_on_first_use=True,
    )
    # Libraries that use stdlib logging go to the same stream, at this level or `libraries`, whichever is higher.
    floor = logging.getLevelNamesMapping()[libraries.upper()]
    logging.basicConfig(level=max(numeric, floor), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
