"""protocol.connection: the sentinel and cluster URL forms, parsed; plain URLs still reach a real server. (The
cluster client against a real 3-shard cluster: tests/serve/test_cluster.py.)"""

from __future__ import annotations

import pytest
import redis

from protocol.connection import (
    is_cluster_url,
    is_sentinel_url,
    parse_cluster_url,
    parse_sentinel_url,
    redis_from_url,
)
from protocol.redaction import redact_url


def test_full_sentinel_url():
    s = parse_sentinel_url("redis+sentinel://:s3cr%40t@10.0.0.1:26380,sent-b,sent-c:5000/jobs-primary/3")
    assert s.hosts == (("10.0.0.1", 26380), ("sent-b", 26379), ("sent-c", 5000))
    assert (s.service, s.db, s.password, s.username, s.ssl) == ("jobs-primary", 3, "s3cr@t", None, False)


def test_tls_user_and_sentinel_password():
    s = parse_sentinel_url("rediss+sentinel://app:pw@h1:1/mymaster?sentinel_password=sp")
    assert (s.hosts, s.service, s.db) == ((("h1", 1),), "mymaster", 0)
    assert (s.username, s.password, s.sentinel_password, s.ssl) == ("app", "pw", "sp", True)


@pytest.mark.parametrize("parse, url, problem", [
    (parse_sentinel_url, "redis+sentinel://h1:26379", "names no service"),
    (parse_sentinel_url, "redis+sentinel://h1:26379/svc/x", "not a number"),
    (parse_sentinel_url, "redis+sentinel://h1:port/svc", "bad sentinel port"),
    (parse_sentinel_url, "redis+sentinel://h1,,h2/svc", "empty sentinel host"),
    (parse_sentinel_url, "redis+sentinel://h1/svc/0/extra", "expected /service_name"),
    (parse_sentinel_url, "redis+sentinel://h1/svc?ssl=1", "unknown sentinel URL parameter"),
    # TLS options need rediss
    (parse_sentinel_url, "redis+sentinel://h1/svc?ssl_ca_certs=/ca.crt", "unknown sentinel URL parameter"),
    (parse_sentinel_url, "redis://h1/0", "not a sentinel URL"),
    (parse_cluster_url, "redis+cluster://h1:7000/3", "only db 0"),
    (parse_cluster_url, "redis+cluster://h1:x", "bad cluster node port"),
    (parse_cluster_url, "redis+cluster://h1,,h2", "empty cluster node host"),
    (parse_cluster_url, "redis+cluster://h1?ssl_ca_certs=/ca.crt", "unknown cluster URL parameter"),  # TLS: rediss
    (parse_cluster_url, "redis+sentinel://h1/svc", "not a cluster URL"),
], ids=lambda v: getattr(v, "__name__", None))
def test_bad_urls_say_what_is_wrong(parse, url, problem):
    with pytest.raises(ValueError, match=problem):
        parse(url)


def test_tls_options_reach_the_sentinels_and_the_primary():
    url = "rediss+sentinel://:pw@127.0.0.1:1,127.0.0.1:2/svc/2?ssl_ca_certs=/tls/ca.crt&ssl_check_hostname=false"
    r = redis_from_url(url, decode_responses=True, socket_timeout=3)  # connects lazily: nothing is dialled
    node = r.connection_pool.connection_kwargs
    assert r.connection_pool.connection_class.__name__ == "SentinelManagedSSLConnection"
    assert (node["db"], node["password"], node["ssl_ca_certs"], node["ssl_check_hostname"]) == (
        2, "pw", "/tls/ca.crt", False)
    sentinel = r.connection_pool.sentinel_manager.sentinels[0].connection_pool
    assert sentinel.connection_class is redis.SSLConnection
    assert sentinel.connection_kwargs["ssl_ca_certs"] == "/tls/ca.crt"


def test_scheme_detection_and_redaction():
    assert is_sentinel_url("REDIS+SENTINEL://h/s") and is_sentinel_url("rediss+sentinel://h/s")
    assert not is_sentinel_url("redis://h:6379/0") and not is_sentinel_url("rediss://h/0")
    shown = redact_url("redis+sentinel://:hunter2@h1:26379,h2:26380/svc/0")
    assert "hunter2" not in shown and "h1:26379,h2:26380/svc/0" in shown


def test_plain_url_makes_a_plain_client(redis_server):
    r = redis_from_url(redis_server.url, decode_responses=True)
    assert type(r.connection_pool) is redis.ConnectionPool
    r.set("k", "v")
    assert r.get("k") == "v"


def test_cluster_urls():
    c = parse_cluster_url("redis+cluster://app:p%40w@10.0.0.1:7000,node-b,node-c:7002")
    assert c.hosts == (("10.0.0.1", 7000), ("node-b", 6379), ("node-c", 7002))
    assert (c.username, c.password, c.ssl) == ("app", "p@w", False)
    t = parse_cluster_url("rediss+cluster://:pw@h1:7000/?ssl_ca_certs=/tls/ca.crt")
    assert (t.password, t.ssl, t.ssl_options) == ("pw", True, (("ssl_ca_certs", "/tls/ca.crt"),))
    assert is_cluster_url("REDIS+CLUSTER://h") and not is_cluster_url("redis://h/0")
    assert not is_sentinel_url("redis+cluster://h")
    shown = redact_url("redis+cluster://:hunter2@h1:7000,h2:7001")
    assert "hunter2" not in shown and "h1:7000,h2:7001" in shown
