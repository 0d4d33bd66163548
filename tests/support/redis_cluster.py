"""A throwaway Redis Cluster on loopback: N masters, no replicas (real redis-server processes with
`--cluster-enabled yes`, each on a free port in its own temp dir, joined by `redis-cli --cluster create`).

    with RedisCluster(3) as c:     # starts the nodes, creates the cluster, waits until every slot is served
        c.url                      # "redis+cluster://127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3"
        c.port_of_key("{a}:x")     # the port of the node that owns the key's slot
"""

from __future__ import annotations

import subprocess
import time

import redis

from tests.support.local_redis import RedisServer


class ClusterNode(RedisServer):
    def _args(self) -> list[str]:
        # The node writes its cluster state to nodes.conf in its own temp dir (two nodes must not share one).
        return super()._args() + ["--cluster-enabled", "yes", "--cluster-config-file", str(self.dir / "nodes.conf"),
                                  "--cluster-node-timeout", "2000"]


class RedisCluster:
    def __init__(self, masters: int = 3) -> None:
        self.nodes = [ClusterNode() for _ in range(masters)]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self, timeout: float = 30.0) -> RedisCluster:
        for n in self.nodes:
            n.start()
        out = subprocess.run(["redis-cli", "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
                              "--cluster-replicas", "0", "--cluster-yes"],
                             capture_output=True, text=True, timeout=timeout)
        if out.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
        deadline = time.monotonic() + timeout
        while not self._ok():  # every node agrees the 16384 slots are served
            if time.monotonic() > deadline:
                raise AssertionError(f"the cluster did not reach cluster_state:ok within {timeout} s")
            time.sleep(0.05)
        return self

    def _ok(self) -> bool:
        for n in self.nodes:
            with n.client(decode_responses=True) as r:
                if r.execute_command("CLUSTER INFO").get("cluster_state") != "ok":
                    return False
        return True

    def port_of_key(self, key: str) -> int:
        """The port of the node that owns `key`'s slot (asked of the nodes themselves, not of the client)."""
        with self.nodes[0].client(decode_responses=True) as r:
            slot = int(r.execute_command("CLUSTER KEYSLOT", key))
            for start, end, (_host, port, *_id), *_replicas in r.execute_command("CLUSTER SLOTS"):
                if int(start) <= slot <= int(end):
                    return int(port)
        raise AssertionError(f"no node serves slot {slot} of {key!r}")

    def node(self, port: int) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=port, decode_responses=True)

    def cleanup(self) -> None:
        for n in self.nodes:
            n.cleanup()

    def __enter__(self) -> RedisCluster:
        try:
            return self.start()
        except BaseException:
            self.cleanup()
            raise

    def __exit__(self, *exc) -> None:
        self.cleanup()
