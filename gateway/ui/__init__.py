"""The dashboard at /ui: server-rendered pages (Jinja2) made live by htmx polling and server-sent events, with
uPlot charts. htmx and uPlot are vendored under static/vendor (with their licences): nothing is fetched at run
time and there is no build step. docs/gateway.md ("Dashboard") describes the pages, the roles and the settings.
"""

from __future__ import annotations

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import FileResponse, PlainTextResponse, RedirectResponse, Response

from gateway.ui import actions, pages
from gateway.ui.render import HEADERS, HERE, Current
from gateway.ui.session import Forbidden, NotLoggedIn

STATIC = {p.name: p for p in (HERE / "static").rglob("*") if p.is_file()}  # fixed at start: no path tricks
TYPES = {".js": "text/javascript", ".css": "text/css", ".LICENSE": "text/plain"}

static = APIRouter(prefix="/ui", include_in_schema=False)


@static.get("/static/{name}")
async def asset(name: str, _sess: Current) -> Response:
    """Scripts and styles, for logged-in sessions only (the login page inlines its few styles)."""
    path = STATIC.get(name)
    if path is None:
        return PlainTextResponse("not found", status_code=404, headers=HEADERS)
    # the file names carry versions (htmx-2.0.11.min.js): cacheable for a day, privately
    return FileResponse(path, media_type=TYPES.get(path.suffix, "application/octet-stream"),
                        headers=HEADERS | {"cache-control": "private, max-age=86400"})


async def _not_logged_in(request: Request, _exc: Exception) -> Response:
    if request.headers.get("hx-request"):  # a fragment poll after the session ended: htmx goes to the login
        return Response(status_code=401, headers=HEADERS | {"hx-redirect": "/ui/login"})
    if request.method == "GET" and "text/html" in request.headers.get("accept", ""):
        return RedirectResponse("/ui/login", status_code=303, headers=HEADERS)
    return PlainTextResponse("log in at /ui/login first", status_code=401, headers=HEADERS)


async def _forbidden(_request: Request, exc: Exception) -> Response:
    return PlainTextResponse(str(exc), status_code=403, headers=HEADERS)


def mount(app: FastAPI) -> None:
    """Add the dashboard's routes and its two exception handlers to the gateway's app."""
    settings = app.state.ctx.settings
    named = settings.ui_login_owners | settings.ui_readonly_owners | settings.ui_operator_owners
    strangers = named - settings.keys_by_owner.keys()
    if strangers:
        raise ValueError(f"{len(strangers)} key(s) of TOKENBUS_GATEWAY_UI_KEYS / _UI_READONLY_KEYS / "
                         "_UI_OPERATOR_KEYS are not among TOKENBUS_GATEWAY_API_KEYS; the dashboard's keys are API "
                         "keys: add them there too")
    if both := settings.ui_readonly_owners & settings.ui_operator_owners:
        raise ValueError(f"{len(both)} key(s) are in both TOKENBUS_GATEWAY_UI_READONLY_KEYS and _UI_OPERATOR_KEYS: "
                         "an operator acts, a read-only key does not; name each key in one of them")
    app.include_router(actions.router)
    app.include_router(pages.router)
    app.include_router(static)
    app.add_exception_handler(NotLoggedIn, _not_logged_in)
    app.add_exception_handler(Forbidden, _forbidden)
