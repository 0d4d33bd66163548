"""A throwaway real `redis-server` on a free port in a temp dir: the tests start one each (and stop, kill or
restart it), the benchmarks one per run.

    srv = RedisServer()            # picks a free port; appendonly=False -> data lives only in memory
    srv.start(); srv.url           # "redis://127.0.0.1:PORT/0"
    srv.restart()                  # same port; without appendonly the data is gone (crash + empty disk)
    srv.kill()                     # SIGKILL, no shutdown work at all
    srv.stop()                     # SIGTERM and wait; also removes nothing (the temp dir goes with cleanup())

With appendonly=True the server writes an AOF (fsync always) in its temp dir, so restart() keeps the data.
Never uses 6379 unless asked to.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, port: int | None = None, appendonly: bool = False, password: str | None = None) -> None:
        self._fixed_port = port is not None
        self.port = port if port is not None else free_port()
        self.appendonly = appendonly
        self.password = password  # requirepass: the url carries it
        self.dir = Path(tempfile.mkdtemp(prefix="tokenbus-redis-"))
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def client(self, **kwargs) -> redis.Redis:
        return redis.Redis.from_url(self.url, **kwargs)

    def _args(self) -> list[str]:
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
                "--save", "", "--daemonize", "no", "--protected-mode", "no",
                "--logfile", str(self.dir / "redis.log")]
        if self.password:
            args += ["--requirepass", self.password]
        if self.appendonly:
            args += ["--appendonly", "yes", "--appendfsync", "always"]
        else:
            args += ["--appendonly", "no"]
        return args

    def start(self, timeout: float = 10.0) -> RedisServer:
        if self.proc is not None and self.proc.poll() is None:
            return self
        # A free port can be taken between free_port() and bind; retry on a new one unless it was fixed.
        for attempt in range(5):
            self.proc = subprocess.Popen(self._args(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if self._wait_ready(timeout):
                return self
            self._reap()
            if self._fixed_port or attempt == 4:
                break
            self.port = free_port()
        logfile = self.dir / "redis.log"
        log = logfile.read_text(errors="replace")[-2000:] if logfile.exists() else ""
        raise RuntimeError(f"redis-server did not start on port {self.port}:\n{log}")

    def _wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                with redis.Redis(port=self.port, host="127.0.0.1", socket_timeout=0.5, password=self.password) as r:
                    if r.ping():
                        return True
            except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
                pass
            time.sleep(0.02)
        return False

    def _reap(self, sig_kill: bool = False) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.kill() if sig_kill else self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None

    def stop(self) -> None:
        self._reap(sig_kill=False)

    def kill(self) -> None:
        self._reap(sig_kill=True)

    def restart(self, timeout: float = 10.0) -> RedisServer:
        self.stop()
        # Same port so clients holding the URL reconnect to the new process.
        self._fixed_port = True
        return self.start(timeout)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def cleanup(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.cleanup()
