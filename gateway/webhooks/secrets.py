"""Webhook signing secrets: one per API key, derived from the operator's master secret.

With one secret for all keys, a tenant that can verify its own events could also sign events for another
tenant's receiver. Each key's secret is HMAC-SHA256(master, owner id) as a `whsec_` secret; the tenant reads
its own with GET /v1/webhook_secret. Nothing is stored: any gateway or tasks process derives the same one.

Rotation (docs/gateway.md): set TOKENBUS_GATEWAY_WEBHOOK_SECRET to a new master and the old one in
TOKENBUS_GATEWAY_WEBHOOK_PREVIOUS_SECRET. Deliveries then carry two signatures (new and old key secret), so
receivers keep verifying while each tenant fetches its new secret; then unset the previous one.
"""

from __future__ import annotations

import base64
import hashlib
import hmac

from standardwebhooks import Webhook


def _master_bytes(master: str) -> bytes:
    return base64.b64decode(master.removeprefix("whsec_"))


def key_secret(master: str, owner: str) -> str:
    """The `whsec_` signing secret of one API key (owner id)."""
    digest = hmac.new(_master_bytes(master), f"tokenbus-webhook:{owner}".encode(), hashlib.sha256).digest()
    return "whsec_" + base64.b64encode(digest).decode()


def signing_secrets(master: str, previous: str, owner: str) -> list[str]:
    """What a delivery to this owner is signed with: its current secret, and during a rotation the old one."""
    return [key_secret(m, owner) for m in (master, previous) if m]


def check_master(name: str, value: str) -> None:
    """ValueError unless value is a usable Standard Webhooks secret (whsec_ + base64)."""
    try:
        Webhook(value)
        _master_bytes(value)
    except Exception as err:
        raise ValueError(f"{name} is not a usable secret ({err}); use whsec_ and base64, e.g. "
                         "whsec_$(openssl rand -base64 32)") from None
