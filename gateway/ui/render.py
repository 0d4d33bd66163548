"""Jinja2 templates (autoescaped), their filters, the security headers every dashboard answer carries, and the
session dependency the routes share."""

from __future__ import annotations

import datetime as dt
import time
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.responses import HTMLResponse
from jinja2 import Environment, FileSystemLoader, select_autoescape
from starlette.concurrency import run_in_threadpool

from gateway.http import get_ctx
from gateway.ui import session
from gateway.ui.session import Session

HERE = Path(__file__).parent
# Every text a tenant controls is shown cut to this: a batch page of 25 failed lines and 25 jobs stays tens of KB
# whatever their ids and errors hold (one with 400 KB ids rendered 63 MB of HTML a poll, issue #34).
CLIP_CHARS = 300
# No inline script anywhere (script-src 'self'); inline styles for htmx's indicator rule and the login page.
CSP = ("default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
       "connect-src 'self'; frame-ancestors 'none'; form-action 'self'; base-uri 'none'")
HEADERS = {"content-security-policy": CSP, "x-frame-options": "DENY", "x-content-type-options": "nosniff",
           "referrer-policy": "same-origin", "cache-control": "no-store"}


def _when(ts: float | None) -> str:
    if not ts:
        return "—"
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _duration(s: float | None) -> str:
    if s is None:
        return "—"
    if s < 1:
        return f"{s * 1000:.0f} ms"
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


def _clip(value: object, limit: int = CLIP_CHARS) -> str:
    """A tenant's text (an id, an error message) cut to `limit` characters, saying how long it was."""
    text = "" if value is None else str(value)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text):,} characters)"


def _sparkline(values: list[float], width: int = 160, height: int = 32) -> str:
    """An inline SVG polyline (server-drawn: it survives every htmx swap without a script)."""
    if len(values) < 2:
        return ""
    top = max(values) or 1.0
    step = width / (len(values) - 1)
    pts = " ".join(f"{i * step:.1f},{height - 2 - (v / top) * (height - 4):.1f}" for i, v in enumerate(values))
    return pts


env = Environment(loader=FileSystemLoader(HERE / "templates"), autoescape=select_autoescape(["html"]),
                  trim_blocks=True, lstrip_blocks=True)
env.filters.update(when=_when, duration=_duration, sparkline=_sparkline, clip=_clip)
env.globals.update(now=time.time, login_css=(HERE / "static" / "ui.css").read_text())  # ours: safe to inline


async def page(name: str, request: Request, sess: Session | None, status: int = 200,
               **values: Any) -> HTMLResponse:
    """A page rendered in a thread: a big page never holds the event loop (nor /healthz) while it renders."""
    html = await run_in_threadpool(env.get_template(name).render, request=request, sess=sess, **values)
    return HTMLResponse(html, status_code=status, headers=HEADERS)


async def current(request: Request) -> Session:
    """FastAPI dependency: the logged-in session, or NotLoggedIn (→ the login page, or 401 for fragments)."""
    return await run_in_threadpool(session.load, get_ctx(request), request)


async def acting(request: Request) -> Session:
    """FastAPI dependency for actions: a session that may act, with the right CSRF token and Origin."""
    sess = await current(request)
    if not sess.can_act:
        raise session.Forbidden("this key is read-only in the dashboard (TOKENBUS_GATEWAY_UI_READONLY_KEYS)")
    session.check_csrf(request, sess)
    return sess


Current = Annotated[Session, Depends(current)]  # a route parameter: the logged-in session
Acting = Annotated[Session, Depends(acting)]  # a route parameter: an operator's session, CSRF checked
