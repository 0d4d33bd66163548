"""A throwaway Redis Cluster on loopback: N masters, each with R replicas (real redis-server processes with
`--cluster-enabled yes`, each on a free port in its own temp dir, joined by `redis-cli --cluster create`).

    with RedisCluster(3) as c:     # starts the nodes, creates the cluster, waits until every slot is served
        c.url                      # "redis+cluster://127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3"
        c.port_of_key("{a}:x")     # the port of the node that owns the key's slot

    with RedisCluster(3, replicas=1, node_timeout_ms=1500) as c:   # + one replica per master, in sync
        old = c.port_of_key("{a}:x")
        c.server(old).kill()       # SIGKILL that master
        c.wait_promoted("{a}:x", old, 15)   # until its replica serves the slot and the cluster is ok
"""

from __future__ import annotations

import subprocess

import redis

from testbed.polling import until
from testbed.redis_server import RedisServer


class ClusterNode(RedisServer):
    def __init__(self, node_timeout_ms: int = 2000) -> None:
        super().__init__()
        self.node_timeout_ms = node_timeout_ms

    def _args(self) -> list[str]:
        # The node writes its cluster state to nodes.conf in its own temp dir (two nodes must not share one).
        # Redis 7 waits 5 s before a diskless full sync for more replicas to join: one replica needs no wait.
        return super()._args() + ["--cluster-enabled", "yes", "--cluster-config-file", str(self.dir / "nodes.conf"),
                                  "--cluster-node-timeout", str(self.node_timeout_ms),
                                  "--repl-diskless-sync-delay", "0"]


class RedisCluster:
    def __init__(self, masters: int = 3, replicas: int = 0, node_timeout_ms: int = 2000) -> None:
        self.masters, self.replicas = masters, replicas
        # redis-cli --cluster create makes the first `masters` nodes masters and the rest their replicas
        self.nodes = [ClusterNode(node_timeout_ms) for _ in range(masters * (1 + replicas))]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes[:self.masters])

    def start(self, timeout: float = 30.0) -> RedisCluster:
        for n in self.nodes:
            n.start()
        out = subprocess.run(["redis-cli", "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
                              "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                             capture_output=True, text=True, timeout=timeout)
        if out.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
        # every node agrees the 16384 slots are served, and every replica has synced with its master
        until(lambda: self._ok() and self._synced(), timeout, "cluster_state:ok and every replica in sync")
        return self

    def live(self) -> list[ClusterNode]:
        return [n for n in self.nodes if n.running]

    def _ok(self) -> bool:
        for n in self.live():
            with n.client(decode_responses=True) as r:
                if r.execute_command("CLUSTER INFO").get("cluster_state") != "ok":
                    return False
        return True

    def _synced(self) -> bool:
        for n in self.live():
            with n.client(decode_responses=True) as r:
                info = r.info("replication")
            if info["role"] == "slave" and info.get("master_link_status") != "up":
                return False
            if info["role"] == "master" and self.replicas and n in self.nodes[:self.masters]:
                if info.get("connected_slaves", 0) < self.replicas or info.get("slave0", {}).get("state") != "online":
                    return False
        return True

    def server(self, port: int) -> ClusterNode:
        return next(n for n in self.nodes if n.port == port)

    def wait_promoted(self, key: str, old_port: int, timeout: float) -> int:
        """Until a node other than `old_port` serves `key`'s slot (as the live nodes see it) and every live node
        says cluster_state:ok; returns its port."""
        until(lambda: self.port_of_key(key) != old_port and self._ok(), timeout,
              f"a replica to take over the slot of {key!r} from :{old_port}")
        return self.port_of_key(key)

    def port_of_key(self, key: str) -> int:
        """The port of the node that owns `key`'s slot (asked of the nodes themselves, not of the client)."""
        with self.live()[0].client(decode_responses=True) as r:
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

