"""Standard Webhooks (standardwebhooks.com) deliveries: a signed POST, the same message id on every attempt.

Headers: webhook-id (stable per event: receivers dedupe on it), webhook-timestamp (this attempt, unix s),
webhook-signature ("v1,<base64 HMAC-SHA256 of id.timestamp.body>", one per secret, space-separated, so a
rotation can sign with the new and the old secret at once). Each API key has its own secret (secrets.py).
Retries and their backoff belong to RQ (tasks.py); this module makes one attempt and raises unless the
receiver answered 2xx.

Why not httpx: its timeout is per socket operation, so a receiver that trickles a byte every few seconds
held an attempt for minutes, and it resolves the host again after our address check (DNS rebinding). Here
the host is resolved once, every address is checked, the connection goes to a checked address, and one
deadline covers connect, TLS, sending and reading the status line and headers. The body is never read.
"""

from __future__ import annotations

import ipaddress
import socket
import ssl
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from urllib.parse import quote, urlsplit

from standardwebhooks import Webhook

USER_AGENT = "tokenbus-gateway-webhooks/1"
MAX_HEAD_BYTES = 16 * 1024  # the status line and headers we read; the body is never read
Resolver = Callable[..., list]  # socket.getaddrinfo's signature

# Not globally routable, or cloud metadata, whatever ipaddress's tables say in this Python version.
ALWAYS_REFUSED = tuple(ipaddress.ip_network(n) for n in (
    "100.64.0.0/10",      # carrier-grade NAT (RFC 6598); 100.100.100.200 is a cloud metadata address in it
    "169.254.0.0/16",     # link-local, incl. 169.254.169.254 (cloud metadata)
    "fd00:ec2::254/128",  # AWS's IPv6 metadata address
))


class DeliveryFailed(Exception):
    """One attempt failed (non-2xx, timeout, refused address); RQ retries it with backoff."""


def check_url(url: str) -> str | None:
    """None when the URL has a usable shape (http/https with a host), else what is wrong with it."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"webhook_url must be an http:// or https:// URL with a host (got {url[:100]!r})"
    if len(url) > 2048:
        return "webhook_url is longer than 2048 characters"
    return None


def literal_address_problem(url: str, allow_networks: str) -> str | None:
    """At create: a URL whose host is an IP literal outside the public internet is refused up front (a name
    is checked at each delivery, since what it resolves to may change)."""
    host = urlsplit(url).hostname or ""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return None
    problem = address_problem(host, parse_networks(allow_networks))
    return f"webhook_url: {problem}; webhooks go only to public addresses" if problem else None


def parse_networks(spec: str) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    """'127.0.0.0/8, 10.1.0.0/16' -> networks (the operator's allow-list; empty = none)."""
    return tuple(ipaddress.ip_network(n.strip(), strict=False) for n in spec.split(",") if n.strip())


def address_problem(addr: str, allowed: Sequence) -> str | None:
    """None when a webhook may go to this address: globally routable, or inside the allow-list."""
    ip = ipaddress.ip_address(addr.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    if any(ip in net for net in allowed):
        return None
    if not ip.is_global or ip.is_multicast or any(ip in net for net in ALWAYS_REFUSED if net.version == ip.version):
        return f"{ip} is not a globally routable address"
    return None


def resolve_checked(host: str, port: int, allowed: Sequence, resolve: Resolver = socket.getaddrinfo) -> tuple:
    """Resolve once; refuse unless every address is allowed (a mixed answer is refused: no SSRF by
    round-robin). Returns the first address's sockaddr: the one to connect to."""
    try:
        infos = resolve(host, port, type=socket.SOCK_STREAM)
    except OSError as err:
        raise DeliveryFailed(f"cannot resolve {host}: {err}") from None
    if not infos:
        raise DeliveryFailed(f"{host} resolves to no address")
    for info in infos:
        if problem := address_problem(info[4][0], allowed):
            raise DeliveryFailed(f"{host} resolves to {problem}; webhooks go only to public addresses unless "
                                 "TOKENBUS_GATEWAY_WEBHOOK_ALLOW_NETWORKS lists its network")
    return infos[0][0], infos[0][4]


def sign(secrets: Sequence[str], msg_id: str, body: str, when: datetime | None = None) -> dict[str, str]:
    """The three Standard Webhooks headers for one attempt; one signature per secret."""
    when = when or datetime.now(tz=UTC)
    sigs = " ".join(Webhook(s).sign(msg_id, when, body) for s in secrets)
    return {"webhook-id": msg_id, "webhook-timestamp": str(int(when.timestamp())), "webhook-signature": sigs}


def deliver(url: str, secrets: Sequence[str], msg_id: str, body: str, *, timeout_s: float,
            allowed: Sequence = (), resolve: Resolver = socket.getaddrinfo) -> int:
    """One signed POST within timeout_s in all; returns the status code, raises DeliveryFailed unless 2xx.
    No redirects are followed: a 3xx could point the signed request anywhere, past the address check."""
    deadline = time.monotonic() + timeout_s
    parts = urlsplit(url)
    host, https = parts.hostname or "", parts.scheme == "https"
    port = parts.port or (443 if https else 80)
    family, sockaddr = resolve_checked(host, port, allowed, resolve)
    payload = body.encode()
    # Percent-encode what is not ASCII (already-encoded %XX and the reserved characters stay as they are).
    target = quote((parts.path or "/") + (f"?{parts.query}" if parts.query else ""), safe="/?&=%:@!$'()*+,;~")
    host_header = host if ":" not in host else f"[{host}]"
    if parts.port:
        host_header += f":{parts.port}"
    headers = sign(secrets, msg_id, body) | {"content-type": "application/json", "user-agent": USER_AGENT,
                                             "host": host_header, "content-length": str(len(payload)),
                                             "connection": "close"}
    request = f"POST {target} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    try:
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.settimeout(_left(deadline, url))
            sock.connect(sockaddr)
            if https:
                sock.settimeout(_left(deadline, url))
                sock = ssl.create_default_context().wrap_socket(sock, server_hostname=host)
            sock.settimeout(_left(deadline, url))
            sock.sendall(request.encode("latin-1") + payload)
            status = _read_status(sock, deadline, url)
        finally:
            sock.close()
    except OSError as err:  # refused, reset, TLS errors (ssl.SSLError is an OSError), timeouts
        raise DeliveryFailed(f"POST {url} failed: {err!r}") from None
    if not 200 <= status < 300:
        raise DeliveryFailed(f"POST {url} answered {status}")
    return status


def _left(deadline: float, url: str) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeliveryFailed(f"POST {url} did not answer within the webhook timeout (one deadline for connect, "
                             "send and the response headers)")
    return left


def _read_status(sock: socket.socket, deadline: float, url: str) -> int:
    """Read until the end of the headers, each recv bounded by what is left of the one deadline."""
    head = b""
    while b"\r\n\r\n" not in head:
        sock.settimeout(_left(deadline, url))
        try:
            chunk = sock.recv(4096)
        except TimeoutError:
            _left(deadline, url)
            raise
        if not chunk:
            break
        head += chunk
        if len(head) > MAX_HEAD_BYTES:
            break
    line = head.split(b"\r\n", 1)[0].decode("latin-1")
    version, _, rest = line.partition(" ")
    if not version.startswith("HTTP/") or not rest[:3].isdigit():
        raise DeliveryFailed(f"POST {url}: not an HTTP response ({line[:80]!r})")
    return int(rest[:3])
