"""Standard Webhooks (standardwebhooks.com) deliveries: a signed POST, the same message id on every attempt.

Headers: webhook-id (stable per event: receivers dedupe on it), webhook-timestamp (this attempt, unix s),
webhook-signature ("v1,<base64 HMAC-SHA256 of id.timestamp.body>" with the secret's bytes). Signing uses the
`standardwebhooks` package, so any Standard Webhooks verifier accepts it. Retries and their backoff belong to
RQ (tasks.py); this module makes one attempt and raises unless the receiver answered 2xx.
"""

from __future__ import annotations

import ipaddress
import socket
from datetime import UTC, datetime
from urllib.parse import urlsplit

import httpx
from standardwebhooks import Webhook

USER_AGENT = "tokenbus-gateway-webhooks/1"


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


def _refuse_private(url: str) -> None:
    """Refuse hosts that resolve to loopback, private or link-local addresses (no SSRF into the network)."""
    parts = urlsplit(url)
    try:
        infos = socket.getaddrinfo(parts.hostname, parts.port or (443 if parts.scheme == "https" else 80))
    except OSError as err:
        raise DeliveryFailed(f"cannot resolve {parts.hostname}: {err}") from None
    for info in infos:
        addr = ipaddress.ip_address(info[4][0])
        if addr.is_private or addr.is_loopback or addr.is_link_local or addr.is_reserved or addr.is_multicast:
            raise DeliveryFailed(f"{parts.hostname} resolves to {addr}, a non-public address; set "
                                 "TOKENBUS_GATEWAY_WEBHOOK_ALLOW_PRIVATE=true to allow it")


def sign(secret: str, msg_id: str, body: str, when: datetime | None = None) -> dict[str, str]:
    """The three Standard Webhooks headers for one attempt."""
    when = when or datetime.now(tz=UTC)
    return {"webhook-id": msg_id, "webhook-timestamp": str(int(when.timestamp())),
            "webhook-signature": Webhook(secret).sign(msg_id, when, body)}


def deliver(url: str, secret: str, msg_id: str, body: str, *, timeout_s: float, allow_private: bool) -> int:
    """One signed POST; returns the status code, raises DeliveryFailed unless it was 2xx."""
    if not allow_private:
        _refuse_private(url)
    headers = sign(secret, msg_id, body) | {"content-type": "application/json", "user-agent": USER_AGENT}
    try:
        # No redirects: a 3xx could point the signed request anywhere, past the address check.
        resp = httpx.post(url, content=body.encode(), headers=headers, timeout=timeout_s, follow_redirects=False)
    except httpx.HTTPError as err:
        raise DeliveryFailed(f"POST {url} failed: {err!r}") from None
    if not 200 <= resp.status_code < 300:
        raise DeliveryFailed(f"POST {url} answered {resp.status_code}: {resp.text[:200]!r}")
    return resp.status_code
