"""Dashboard sessions: log in once with a gateway API key, then an HttpOnly SameSite=Strict cookie.

The cookie holds a random token only; Redis holds `{ns}:gw:ui:session:{sha256(token)}` = owner, role, csrf
(with a TTL), so the key itself is never stored in the browser nor shown again. Every state-changing request
carries the session's CSRF token (htmx sends it as X-CSRF-Token; plain forms as a hidden field) and, when the
browser sends one, an Origin that is this host: SameSite=Strict alone does not cover old browsers or subdomains.

A session's role is worked out again from the settings at every request (a key made read-only, or taken off the
dashboard's keys, loses its rights in the sessions it has open at their next request), and each key keeps at
most `ui_max_sessions_per_key` sessions: a login past that ends the key's oldest one (the key's holder can always
log in; a script logging in in a loop holds no more than the cap). What a session holds in Redis counts against
the key's byte limits (batches/capacity.py) until it expires, or until its logout or eviction gives it back.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from fastapi import Request

from gateway.batches import capacity
from gateway.byte_limits import INDEX_ENTRY_BYTES, STORED_CODES, raise_for
from gateway.settings import owner_id
from protocol.scripts import lua, script

COOKIE = "tb_session"
LOGIN_COOKIE = "tb_login"  # the login form's own CSRF token (double submit: there is no session yet)
CSRF_HEADER = "x-csrf-token"
# operator: acts on its own objects and sees every key's dead letters (opt-in: UI_OPERATOR_KEYS); tenant: acts on
# its own objects only; viewer: sees its own objects and acts on nothing (UI_READONLY_KEYS).
OPERATOR, TENANT, VIEWER = "operator", "tenant", "viewer"

_LOGIN = lua("ui_login")  # protocol/lua/ui_login.lua: the session, its bytes and the key's cap in one step
_LOGOUT = lua("ui_logout")  # protocol/lua/ui_logout.lua


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
        return self.role in (OPERATOR, TENANT)

    @property
    def operator(self) -> bool:
        """Sees (and acts on) every key's dead letters, not only its own."""
        return self.role == OPERATOR


def _hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def role_for(ctx, owner: str) -> str | None:
    """The dashboard role of an owner under the settings now: None when it may not log in (or be logged in)."""
    s = ctx.settings
    if owner not in ctx.api_keys or (s.ui_login_owners and owner not in s.ui_login_owners):
        return None
    if owner in s.ui_readonly_owners:
        return VIEWER
    return OPERATOR if owner in s.ui_operator_owners else TENANT


def role_of(ctx, api_key: str) -> str | None:
    """The dashboard role of a key: None when it may not log in (unknown, or not among ui_keys)."""
    who = owner_id(api_key)
    known = ctx.api_keys.get(who)
    # Compared in constant time; looked up by hash so the lookup says nothing about near misses.
    if known is None or not hmac.compare_digest(known.encode(), api_key.encode()):
        return None
    return role_for(ctx, who)


def create(ctx, api_key: str) -> tuple[str, Session] | None:
    """A new session for a valid key: (cookie token, session), or None. Past the key's cap, its oldest go. What
    it holds in Redis counts against the key's byte limits until it expires (UI_LOGIN): past them, 429."""
    role = role_of(ctx, api_key)
    if role is None:
        return None
    token = secrets.token_urlsafe(32)
    sess = Session(_hash(token), owner_id(api_key), role, secrets.token_urlsafe(32), time.time())
    s = ctx.settings
    fields = {"owner": sess.owner, "role": sess.role, "csrf": sess.csrf, "created_at": sess.created_at}
    code, value, *limits = script(_LOGIN)(
        keys=[ctx.gkeys.ui_session(sess.token_hash), ctx.gkeys.ui_sessions(sess.owner), ctx.gkeys.queued_bytes,
              *capacity.ledgers(ctx, sess.owner), ctx.gkeys.config],
        args=[sess.owner, sess.token_hash, sess.created_at, s.ui_session_ttl_s, s.ui_max_sessions_per_key,
              capacity.until_s(sess.created_at, s.ui_session_ttl_s), s.max_queued_bytes_per_key,
              s.max_queued_bytes, ctx.gkeys.ui_session(""), INDEX_ENTRY_BYTES,
              *[x for kv in fields.items() for x in kv]],
        client=ctx.redis)
    if int(code) < 0:
        per_key, total, need = map(int, limits)
        raise_for(int(code), int(value), need, per_key, total, "login", STORED_CODES,
                           "log out of a session you no longer use")
    return token, sess


def load(ctx, request: Request) -> Session:
    token = request.cookies.get(COOKIE, "")
    if not token or len(token) > 128:
        raise NotLoggedIn()
    token_hash = _hash(token)
    raw = ctx.redis.hgetall(ctx.gkeys.ui_session(token_hash))
    if not raw:
        raise NotLoggedIn()
    # The role the settings give the key now, not the one it logged in with: a key removed from the API keys
    # or the dashboard's keys ends its sessions at once, a key made read-only acts no more.
    role = role_for(ctx, raw["owner"])
    if role is None:
        raise NotLoggedIn()
    return Session(token_hash, raw["owner"], role, raw["csrf"], float(raw["created_at"]))


def destroy(ctx, sess: Session) -> None:
    """End the session now and give back the bytes it was counted for (UI_LOGOUT)."""
    script(_LOGOUT)(keys=[ctx.gkeys.ui_session(sess.token_hash), ctx.gkeys.ui_sessions(sess.owner),
                          *capacity.ledgers(ctx, sess.owner)], args=[sess.token_hash], client=ctx.redis)


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
