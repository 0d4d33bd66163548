"""Dashboard sessions: log in once with a gateway API key, then an HttpOnly SameSite=Strict cookie.

The cookie holds a random token only; Redis holds `{ns}:gw:ui:session:{sha256(token)}` = owner, role, csrf
(with a TTL), so the key itself is never stored in the browser nor shown again. Every state-changing request
carries the session's CSRF token (htmx sends it as X-CSRF-Token; plain forms as a hidden field) and, when the
browser sends one, an Origin that is this host: SameSite=Strict alone does not cover old browsers or subdomains.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from fastapi import Request

from gateway.keys import GatewayKeys
from gateway.settings import owner_id

COOKIE = "tb_session"
LOGIN_COOKIE = "tb_login"  # the login form's own CSRF token (double submit: there is no session yet)
CSRF_HEADER = "x-csrf-token"
OPERATOR, VIEWER = "operator", "viewer"


class NotLoggedIn(Exception):
    """No valid session: pages redirect to the login page, fragments and actions answer 401."""


class Forbidden(Exception):
    """A logged-in session that may not do this (a viewer's action, a bad CSRF token or Origin)."""


@dataclass(frozen=True)
class Session:
    token_hash: str
    owner: str
    role: str
    csrf: str
    created_at: float

    @property
    def can_act(self) -> bool:
        return self.role == OPERATOR


def _key(ns: str, token_hash: str) -> str:
    return GatewayKeys(ns).ui_session(token_hash)


def _hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def role_of(ctx, api_key: str) -> str | None:
    """The dashboard role of a key: None when it may not log in (unknown, or not among ui_keys)."""
    who = owner_id(api_key)
    known = ctx.api_keys.get(who)
    # Compared in constant time; looked up by hash so the lookup says nothing about near misses.
    if known is None or not hmac.compare_digest(known.encode(), api_key.encode()):
        return None
    s = ctx.settings
    if s.ui_login_owners and who not in s.ui_login_owners:
        return None
    return VIEWER if who in s.ui_readonly_owners else OPERATOR


def create(ctx, api_key: str) -> tuple[str, Session] | None:
    """A new session for a valid key: (cookie token, session), or None."""
    role = role_of(ctx, api_key)
    if role is None:
        return None
    token = secrets.token_urlsafe(32)
    sess = Session(_hash(token), owner_id(api_key), role, secrets.token_urlsafe(32), time.time())
    key = _key(ctx.settings.namespace, sess.token_hash)
    pipe = ctx.redis.pipeline(transaction=True)
    pipe.hset(key, mapping={"owner": sess.owner, "role": sess.role, "csrf": sess.csrf,
                            "created_at": sess.created_at})
    pipe.expire(key, ctx.settings.ui_session_ttl_s)
    pipe.execute()
    return token, sess


def load(ctx, request: Request) -> Session:
    token = request.cookies.get(COOKIE, "")
    if not token or len(token) > 128:
        raise NotLoggedIn()
    token_hash = _hash(token)
    raw = ctx.redis.hgetall(_key(ctx.settings.namespace, token_hash))
    if not raw:
        raise NotLoggedIn()
    # A key removed from the settings ends its sessions at once, not at their TTL.
    if raw["owner"] not in ctx.api_keys:
        raise NotLoggedIn()
    return Session(token_hash, raw["owner"], raw["role"], raw["csrf"], float(raw["created_at"]))


def destroy(ctx, sess: Session) -> None:
    ctx.redis.delete(_key(ctx.settings.namespace, sess.token_hash))


def check_origin(request: Request) -> None:
    """A cross-site POST names another origin (browsers send Origin on every POST); refuse it."""
    origin = request.headers.get("origin")
    if origin is None:  # not a browser, or a same-origin GET-like request: the CSRF token decides
        return
    host = request.headers.get("host", "")
    if urlsplit(origin).netloc != host:
        raise Forbidden(f"cross-origin request refused (Origin {origin!r}, host {host!r})")


def check_csrf(request: Request, sess: Session, form_token: str | None = None) -> None:
    check_origin(request)
    sent = request.headers.get(CSRF_HEADER) or form_token or ""
    if not hmac.compare_digest(sent.encode(), sess.csrf.encode()):
        raise Forbidden("missing or wrong CSRF token: reload the page and try again")


def cookie_args(request: Request, ttl_s: int, secure: bool | None) -> dict:
    """HttpOnly (no script reads it), SameSite=Strict, Secure behind HTTPS, scoped to /ui."""
    https = request.url.scheme == "https" or request.headers.get("x-forwarded-proto") == "https"
    return {"httponly": True, "samesite": "strict", "secure": https if secure is None else secure,
            "path": "/ui", "max_age": ttl_s}
