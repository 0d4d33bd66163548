"""The one place a tokenbus process makes a Redis client: plain `redis://` / `rediss://` / `unix://` URLs,
Redis Sentinel for high availability, or Redis Cluster to spread namespaces over shards.

    redis+sentinel://[[user]:password@]host1[:port1],host2[:port2],.../service_name[/db][?sentinel_password=...]
    rediss+sentinel://...   the same over TLS (to the sentinels and to the primary); it also reads
                            ?ssl_ca_certs= (and ssl_certfile, ssl_keyfile, ssl_cert_reqs, ssl_check_hostname)

The hosts are the sentinels (port 26379 when left out); service_name is the primary's name in their
configuration (`sentinel monitor NAME ...`); db defaults to 0. The password in the userinfo is the data nodes'
(`requirepass`); sentinels that have their own take `?sentinel_password=`. The client asks the sentinels for the
current primary on every new connection, so after a failover the next retry lands on the promoted replica.

    redis+cluster://[[user]:password@]host1[:port1],host2[:port2],...[?ssl_ca_certs=...]
    rediss+cluster://...    the same over TLS

The hosts are any cluster nodes to start from (port 6379 when left out; the client learns the rest with
CLUSTER SLOTS); a cluster has only db 0, so there is no path. The client (redis.cluster.RedisCluster) sends
each command to the shard that owns its key's slot. Every key of a namespace carries the hash tag `{ns}`
(protocol/keys.py), so one namespace lives on one shard and its scripts run there; docs/deployment.md,
"Redis Cluster", says what that allows and what it does not.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import redis
from redis.sentinel import Sentinel

SENTINEL_SCHEMES = {"redis+sentinel": False, "rediss+sentinel": True}  # scheme -> TLS
CLUSTER_SCHEMES = {"redis+cluster": False, "rediss+cluster": True}  # scheme -> TLS
DEFAULT_SENTINEL_PORT = 26379
DEFAULT_CLUSTER_PORT = 6379
SSL_PARAMS = {"ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs", "ssl_check_hostname"}


@dataclass(frozen=True)
class SentinelURL:
    hosts: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_password: str | None = None
    ssl: bool = False
    ssl_options: tuple[tuple[str, str], ...] = ()  # ?ssl_ca_certs=...: for the sentinels and the primary


def is_sentinel_url(url: str) -> bool:
    return url.split("://", 1)[0].lower() in SENTINEL_SCHEMES


@dataclass(frozen=True)
class ClusterURL:
    hosts: tuple[tuple[str, int], ...]  # startup nodes
    username: str | None = None
    password: str | None = None
    ssl: bool = False
    ssl_options: tuple[tuple[str, str], ...] = ()


def is_cluster_url(url: str) -> bool:
    return url.split("://", 1)[0].lower() in CLUSTER_SCHEMES


def _userinfo_and_hosts(netloc: str, default_port: int, what: str) -> tuple[str | None, str | None, list]:
    """(username, password, [(host, port)]) of `[[user]:password@]h1[:p1],h2[:p2],...`."""
    # urlsplit would read "h1:1,h2:2" as one host with a bad port: split the netloc by hand.
    userinfo, at, hostlist = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, pw = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(pw) if colon else unquote(user)
        if not colon:
            username = None
    hosts: list[tuple[str, int]] = []
    for item in hostlist.split(","):
        host, colon, port = item.strip().rpartition(":") if ":" in item else (item.strip(), "", "")
        if not host:
            raise ValueError(f"empty {what} host in {hostlist!r}: write host[:port],host[:port],...")
        try:
            hosts.append((host, int(port) if colon else default_port))
        except ValueError:
            raise ValueError(f"bad {what} port {port!r} in {hostlist!r}") from None
    return username, password, hosts


def _split(url: str, kind: str, schemes: dict[str, bool], default_port: int, host_word: str) -> tuple:
    """What the sentinel and cluster forms share: (urlsplit parts, TLS or not, username, password, hosts, query),
    or a ValueError for another scheme or a bad host list."""
    scheme, sep, _ = url.partition("://")
    if not sep or scheme.lower() not in schemes:
        raise ValueError(f"not a {kind} URL (expected redis+{kind}:// or rediss+{kind}://): {scheme}://...")
    parts = urlsplit(url)
    username, password, hosts = _userinfo_and_hosts(parts.netloc, default_port, host_word)
    return parts, schemes[scheme.lower()], username, password, tuple(hosts), parse_qs(parts.query)


def _ssl_options(query: dict[str, list[str]]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v[0]) for k, v in query.items() if k in SSL_PARAMS))


def parse_cluster_url(url: str) -> ClusterURL:
    """A redis+cluster:// URL's parts; ValueError saying what is wrong with it otherwise."""
    parts, ssl, username, password, hosts, query = _split(url, "cluster", CLUSTER_SCHEMES, DEFAULT_CLUSTER_PORT,
                                                          "cluster node")
    if parts.path.strip("/") not in ("", "0"):
        raise ValueError(f"cluster URL path {parts.path!r}: a Redis Cluster has only db 0, write no path")
    unknown = set(query) - (SSL_PARAMS if ssl else set())
    if unknown:
        raise ValueError(f"unknown cluster URL parameter(s) {sorted(unknown)}: "
                         + (f"rediss+cluster:// reads {', '.join(sorted(SSL_PARAMS))}" if ssl else
                            "redis+cluster:// reads none (TLS options go with rediss+cluster://)"))
    return ClusterURL(hosts, username, password, ssl, _ssl_options(query))


def parse_sentinel_url(url: str) -> SentinelURL:
    """A redis+sentinel:// URL's parts; ValueError saying what is wrong with it otherwise."""
    parts, ssl, username, password, hosts, query = _split(url, "sentinel", SENTINEL_SCHEMES, DEFAULT_SENTINEL_PORT,
                                                          "sentinel")
    segments = [s for s in parts.path.split("/") if s]
    if not segments:
        raise ValueError("sentinel URL names no service: write redis+sentinel://host:port/SERVICE_NAME[/db]")
    if len(segments) > 2:
        raise ValueError(f"sentinel URL path {parts.path!r}: expected /service_name[/db]")
    try:
        db = int(segments[1]) if len(segments) == 2 else 0
    except ValueError:
        raise ValueError(f"sentinel URL db {segments[1]!r} is not a number") from None
    unknown = set(query) - {"sentinel_password"} - (SSL_PARAMS if ssl else set())
    if unknown:
        raise ValueError(f"unknown sentinel URL parameter(s) {sorted(unknown)}: sentinel_password is read, and "
                         f"with rediss+sentinel:// also {', '.join(sorted(SSL_PARAMS))}")
    sentinel_password = query.get("sentinel_password", [None])[0]
    return SentinelURL(hosts, unquote(segments[0]), db, username, password, sentinel_password, ssl,
                       _ssl_options(query))


def redis_from_url(url: str, **kwargs: Any) -> redis.Redis:
    """A client for `url`; kwargs as redis.Redis.from_url takes them (decode_responses, socket_timeout, ...).

    For a sentinel URL, the client's connections come from the sentinels' current primary for the service; for
    a cluster URL it is a redis.cluster.RedisCluster (the same commands, each sent to its key's shard) whose
    pipelines send scripts as EVALSHA (protocol.cluster.ScriptCluster)."""
    return _client(url, kwargs, redis.Redis, Sentinel, ("protocol.cluster:ScriptCluster", "redis.cluster:ClusterNode"))


def async_redis_from_url(url: str, **kwargs: Any) -> Any:
    """redis_from_url for asyncio code (the gateway's /healthz)."""
    import redis.asyncio as aioredis
    from redis.asyncio.sentinel import Sentinel as AsyncSentinel

    return _client(url, kwargs, aioredis.Redis, AsyncSentinel,
                   ("redis.asyncio.cluster:RedisCluster", "redis.asyncio.cluster:ClusterNode"))


def _client(url: str, kwargs: dict[str, Any], plain: Any, sentinel: Any, cluster: tuple[str, str]) -> Any:
    """The one choice of client for a URL, sync or async by the classes given (cluster: the cluster client's
    and its node's "module:Class", imported only for a cluster URL)."""
    if is_cluster_url(url):
        client_class, node_class = (getattr(importlib.import_module(m), n) for m, _, n in
                                    (name.partition(":") for name in cluster))
        hosts, node = _cluster_parts(url, kwargs)
        return client_class(startup_nodes=[node_class(h, p) for h, p in hosts], **node)
    if not is_sentinel_url(url):
        return plain.from_url(url, **kwargs)
    hosts, service, node, sentinel_kwargs = _sentinel_parts(url, kwargs)
    return sentinel(hosts, sentinel_kwargs=sentinel_kwargs).master_for(service, **node)


def _tls(ssl: bool, options: tuple[tuple[str, str], ...]) -> dict[str, Any]:
    tls: dict[str, Any] = {"ssl": True, **dict(options)} if ssl else {}
    if "ssl_check_hostname" in tls:
        tls["ssl_check_hostname"] = tls["ssl_check_hostname"].lower() in ("1", "true", "yes", "on")
    return tls


def _cluster_parts(url: str, kwargs: dict[str, Any]) -> tuple[list[tuple[str, int]], dict[str, Any]]:
    """(startup nodes, the nodes' connection kwargs)."""
    c = parse_cluster_url(url)
    node: dict[str, Any] = {k: v for k, v in kwargs.items() if k != "db"}
    _defaults(node, c.username, c.password, _tls(c.ssl, c.ssl_options))
    return list(c.hosts), node


def _defaults(node: dict[str, Any], username: str | None, password: str | None, tls: dict[str, Any]) -> None:
    """The URL's credentials and TLS options into a node's connection kwargs, where the caller set none."""
    for key, value in {"password": password, "username": username, **tls}.items():
        if value is not None:
            node.setdefault(key, value)


def is_cluster(r: Any) -> bool:
    """Whether `r` is a Redis Cluster client (sync or async) or one of its pipelines."""
    from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
    from redis.cluster import ClusterPipeline, RedisCluster

    return isinstance(r, RedisCluster | ClusterPipeline | AsyncRedisCluster)


def on_shard(r: Any, key: str) -> dict[str, Any]:
    """kwargs that send a keyless command (WAIT, INFO) to the shard that owns `key`: `{"target_nodes": node}`
    for a cluster client, {} otherwise (a single Redis is that shard)."""
    return {"target_nodes": slot_owner(r, key)} if is_cluster(r) else {}


def shard_client(r: Any, key: str) -> Any:
    """A plain client of the shard that owns `key` (all of a namespace's keys share its slot), for code that
    drives a connection itself (SubmitPipe's pipelined raw replies); `r` itself when it is not a cluster."""
    return slot_owner(r, key).redis_connection if is_cluster(r) else r


def slot_owner(r: Any, key: str) -> Any:
    """The node of cluster client or pipeline `r` that owns `key`'s slot, as its slot table names it now."""
    return r.nodes_manager.get_node_from_slot(r.keyslot(key))


def socket_timeout(r: Any) -> float | None:
    """The socket timeout `r`'s connections were made with (None: none)."""
    kwargs = r.nodes_manager.connection_kwargs if is_cluster(r) else r.connection_pool.connection_kwargs
    return kwargs.get("socket_timeout")


def _sentinel_parts(url: str, kwargs: dict[str, Any]) -> tuple[list, str, dict[str, Any], dict[str, Any]]:
    """(sentinel hosts, service name, the primary's connection kwargs, the sentinels' connection kwargs)."""
    s = parse_sentinel_url(url)
    node: dict[str, Any] = {"db": s.db, **kwargs}
    tls = _tls(s.ssl, s.ssl_options)
    _defaults(node, s.username, s.password, tls)
    # The sentinels answer fast or not at all: a short timeout lets the client move on to the next one.
    sentinel_kwargs: dict[str, Any] = {"socket_timeout": 1.0, "socket_connect_timeout": 1.0}
    if s.sentinel_password is not None:
        sentinel_kwargs["password"] = s.sentinel_password
    sentinel_kwargs.update(tls)
    return list(s.hosts), s.service, node, sentinel_kwargs
