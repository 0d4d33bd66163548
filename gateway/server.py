"""uvicorn's HTTP/1.1 protocol with a deadline on request headers (slowloris).

uvicorn times out idle keep-alive connections but not a request whose headers trickle in: a client sending
a header byte every few seconds held a connection (and a file descriptor) for as long as it liked. Here a
connection waiting for a request's headers gets header_timeout_s from its first byte (or from its opening)
to finish them, whatever it sends meanwhile; then it is closed. Bodies have their own rule (limits.py).
"""

from __future__ import annotations

import asyncio

import h11
import structlog
from uvicorn.protocols.http.h11_impl import H11Protocol

log = structlog.get_logger("tokenbus.gateway")


def protocol_with_header_deadline(header_timeout_s: float) -> type[H11Protocol]:
    class HeaderDeadlineH11(H11Protocol):
        _header_deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self._arm()  # (still) waiting for a request's headers: the clock runs from its first byte
            else:
                self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._header_deadline is None:
                self._header_deadline = self.loop.call_later(header_timeout_s, self._headers_too_slow)

        def _disarm(self) -> None:
            if self._header_deadline is not None:
                self._header_deadline.cancel()
                self._header_deadline = None

        def _headers_too_slow(self) -> None:
            self._header_deadline = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                log.info("http_headers_too_slow", client=str(self.client), timeout_s=header_timeout_s)
                self.transport.close()

    return HeaderDeadlineH11
