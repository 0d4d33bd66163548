"""Background: one daemon thread that serves every request of a kind (StreamHub, JobWaiter, Canceller), started
on first need and stopped once, so no request holds a thread or a pooled connection of its own."""

from __future__ import annotations

import threading


class Background:
    thread_name = "background"

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._interrupt()
        if self._thread is not None:
            self._thread.join(5)
        self._close()

    def _run(self) -> None:
        raise NotImplementedError

    def _interrupt(self) -> None:
        """Wake _run from its wait, so it sees the stop now."""

    def _close(self) -> None:
        """Release what the thread used (after it ended, or after 5 s)."""
