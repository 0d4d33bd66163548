"""A throwaway Sentinel deployment on loopback: one primary, one replica, three sentinels (real redis-server
processes, each on a free port in its own temp dir).

    with SentinelGroup() as g:     # starts everything
        g.wait_ready()             # until the sentinels know each other and the replica
        g.url                      # "redis+sentinel://127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3/tbprimary/0"
        g.primary.kill()           # SIGKILL the primary
        g.wait_promoted(10)        # until the sentinels name the replica as the primary
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import redis

from testbed.polling import until
from testbed.redis_server import RedisServer, free_port

SERVICE = "tbprimary"


class Primary(RedisServer):
    def _args(self) -> list[str]:
        # Redis 7 waits 5 s before a diskless full sync, for more replicas to join: one replica needs no wait.
        return super()._args() + ["--repl-diskless-sync-delay", "0"]


def replica_online(primary: RedisServer) -> bool:
    """The primary counts its replica for WAIT (state=online: it has acknowledged the sync)."""
    info = primary.client(decode_responses=True).info("replication")
    return info.get("connected_slaves", 0) >= 1 and info.get("slave0", {}).get("state") == "online"


class Replica(RedisServer):
    def __init__(self, primary_port: int) -> None:
        super().__init__()
        self.primary_port = primary_port

    def _args(self) -> list[str]:
        return super()._args() + ["--repl-diskless-sync-delay", "0", "--replicaof", "127.0.0.1", str(self.primary_port)]


class SentinelProcess:
    def __init__(self, primary_port: int, down_after_ms: int, failover_timeout_ms: int) -> None:
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="tokenbus-sentinel-"))
        conf = self.dir / "sentinel.conf"  # sentinel rewrites its config: it must be a writable file
        conf.write_text(
            f"port {self.port}\nbind 127.0.0.1\nprotected-mode no\ndaemonize no\ndir {self.dir}\n"
            f"logfile {self.dir / 'sentinel.log'}\n"
            f"sentinel monitor {SERVICE} 127.0.0.1 {primary_port} 2\n"
            f"sentinel down-after-milliseconds {SERVICE} {down_after_ms}\n"
            f"sentinel failover-timeout {SERVICE} {failover_timeout_ms}\n"
            f"sentinel parallel-syncs {SERVICE} 1\n")
        self.proc = subprocess.Popen(["redis-server", str(conf), "--sentinel"], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1, decode_responses=True)

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


class SentinelGroup:
    def __init__(self, down_after_ms: int = 500, failover_timeout_ms: int = 5000) -> None:
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        self.primary = Primary()
        self.replica: Replica | None = None
        self.sentinels: list[SentinelProcess] = []

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{SERVICE}/0"

    def start(self, timeout: float = 30.0, wait: bool = True) -> SentinelGroup:
        self.primary.start()
        self.replica = Replica(self.primary.port)
        self.replica.start()
        self.sentinels = [SentinelProcess(self.primary.port, self.down_after_ms, self.failover_timeout_ms)
                          for _ in range(3)]
        if wait:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Until the replica is in sync and the three sentinels know each other and it (~2 hello periods)."""
        until(self._ready, timeout, "the replica in sync and three sentinels that know each other and it")

    def _ready(self) -> bool:
        if not replica_online(self.primary):
            return False
        for s in self.sentinels:
            with s.client() as c:
                if len(c.sentinel_sentinels(SERVICE)) < 2 or len(c.sentinel_slaves(SERVICE)) < 1:
                    return False
        return True

    def primary_port(self) -> int | None:
        """The port the sentinels name as the primary (the first that answers)."""
        for s in self.sentinels:
            try:
                with s.client() as c:
                    addr = c.sentinel_get_master_addr_by_name(SERVICE)
                return int(addr[1]) if addr else None
            except redis.RedisError:
                continue
        return None

    def wait_promoted(self, timeout: float) -> None:
        until(lambda: self.primary_port() == self.replica.port, timeout, "the sentinels to promote the replica")

    def cleanup(self) -> None:
        for s in self.sentinels:
            s.cleanup()
        if self.replica is not None:
            self.replica.cleanup()
        self.primary.cleanup()

    def __enter__(self) -> SentinelGroup:
        try:
            return self.start(wait=False)  # the caller waits with wait_ready(), doing its own start-up meanwhile
        except BaseException:
            self.cleanup()
            raise

    def __exit__(self, *exc) -> None:
        self.cleanup()
