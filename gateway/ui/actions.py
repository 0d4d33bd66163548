"""The dashboard's actions (POST): log in and out, submit a batch file, cancel a batch or a job, retry or delete
a dead letter. Every one but login needs an operator session, its CSRF token and a same-origin request."""

from __future__ import annotations

import json
import secrets

from fastapi import APIRouter, Form, Path, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from markupsafe import escape
from starlette.concurrency import run_in_threadpool

from gateway.api.completions import submit
from gateway.batches import service as batch_service
from gateway.batches.service import CreateBatch
from gateway.errors import APIError
from gateway.files.upload import receive_upload
from gateway.http import get_ctx
from gateway.jobs import owned_job
from gateway.settings import owner_id
from gateway.throttle import client_of, key_of
from gateway.ui import data, session
from gateway.ui.render import HEADERS, Acting, page
from gateway.ui.session import Session
from protocol.errors import TokenbusError
from protocol.models import JobRequest

router = APIRouter(prefix="/ui", include_in_schema=False)
ENTRY_ID = r"^\d{1,20}-\d{1,20}$"  # a stream entry id


def _notice(message: str, ok: bool = True) -> HTMLResponse:
    """A status line htmx swaps in (role=status/alert so screen readers announce it)."""
    role, cls = ("status", "ok") if ok else ("alert", "error")
    return HTMLResponse(f'<p role="{role}" class="notice {cls}">{escape(message)}</p>', headers=HEADERS)


def _goto(url: str) -> Response:
    return Response(status_code=204, headers=HEADERS | {"hx-redirect": url})


# ---- log in / out ---------------------------------------------------------------------------------------------

@router.get("/login", response_class=HTMLResponse)
async def login_form(request: Request, error: str = "") -> HTMLResponse:
    """The one page served without a session. Its form carries a one-off token also set as a cookie."""
    token = secrets.token_urlsafe(24)
    resp = await page("login.html", request, None, 401 if error else 200, login_token=token, error=error)
    resp.set_cookie(session.LOGIN_COOKIE, token, httponly=True, samesite="strict", path="/ui/login", max_age=900)
    return resp


@router.post("/login")
async def login(request: Request, api_key: str = Form("", max_length=512),
                login_token: str = Form("", max_length=128)) -> Response:
    ctx = get_ctx(request)
    session.check_origin(request)
    expected = request.cookies.get(session.LOGIN_COOKIE, "")
    if not expected or not secrets.compare_digest(expected, login_token):
        return RedirectResponse("/ui/login?error=expired", status_code=303, headers=HEADERS)
    # Throttled before the key is compared, like the API's bearer keys (gateway/throttle.py): the address's bucket
    # is the API's, the key's is the login's own (a key refused here must not lose its API calls)
    names = (client_of(request.client.host if request.client else None),
             "login-" + key_of(owner_id(api_key.strip())))
    if wait_s := ctx.auth_throttle.retry_after(*names):
        resp = await page("login.html", request, None, 429, login_token=login_token, error="throttled", wait_s=wait_s)
        resp.headers["retry-after"] = str(wait_s)
        return resp
    try:
        made = await run_in_threadpool(session.create, ctx, api_key.strip())
    except APIError as err:  # the key's stored bytes are at its limit (session.create): said, nothing kept
        resp = await page("login.html", request, None, err.status, login_token=login_token, error="full",
                          detail=err.message)
        resp.headers.update(err.headers or {})
        return resp
    if made is None:  # the same answer for unknown keys and keys not allowed here: no oracle
        ctx.auth_throttle.failed(*names)
        return RedirectResponse("/ui/login?error=refused", status_code=303, headers=HEADERS)
    token, _sess = made
    resp = RedirectResponse("/ui/", status_code=303, headers=HEADERS)
    resp.set_cookie(session.COOKIE, token, **session.cookie_args(request, ctx.settings.ui_session_ttl_s,
                                                                  ctx.settings.ui_secure_cookie))
    resp.delete_cookie(session.LOGIN_COOKIE, path="/ui/login")
    return resp


@router.post("/logout")
async def logout(request: Request, csrf: str = Form("", max_length=128)) -> Response:
    """A viewer may log out too: only the session and its CSRF token are checked."""
    ctx = get_ctx(request)
    sess = await run_in_threadpool(session.load, ctx, request)
    session.check_csrf(request, sess, csrf)
    await run_in_threadpool(session.destroy, ctx, sess)
    resp = RedirectResponse("/ui/login", status_code=303, headers=HEADERS)
    resp.delete_cookie(session.COOKIE, path="/ui")
    return resp


# ---- batches and jobs -----------------------------------------------------------------------------------------

@router.post("/batches")
async def submit_batch(request: Request, sess: Acting) -> Response:
    """The Batches page's upload form: the file goes through the API's own upload and batch creation."""
    ctx = get_ctx(request)
    try:
        meta = await receive_upload(request, ctx.files, sess.owner)
        if not meta.endpoint:
            raise APIError(400, f"{meta.filename} has no requests", code="invalid_request")
        req = CreateBatch(input_file_id=meta.id, endpoint=meta.endpoint, completion_window="24h")
        obj = await run_in_threadpool(batch_service.create, ctx, sess.owner, req)
    except APIError as err:
        return _notice(f"Not submitted: {err.body()['error']['message']}", ok=False)
    return _goto(f"/ui/batches/{obj['id']}")


@router.post("/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, request: Request, sess: Acting) -> Response:
    try:
        await run_in_threadpool(batch_service.cancel, get_ctx(request), sess.owner, batch_id)
    except APIError as err:
        return _notice(err.body()["error"]["message"], ok=False)
    return _notice("Cancel requested: queued requests are cancelled, running ones stop at their next step.")


@router.post("/jobs/{job_id}/cancel")
async def cancel_job(job_id: str, request: Request, sess: Acting) -> Response:
    ctx = get_ctx(request)

    def cancel() -> str:
        owned_job(ctx, sess.owner, job_id)
        return ctx.client.cancel(job_id)

    try:
        status = await run_in_threadpool(cancel)
    except APIError as err:
        return _notice(err.body()["error"]["message"], ok=False)
    return _notice(f"Cancel sent: the job is {status}.")


# ---- dead letters ---------------------------------------------------------------------------------------------

def _visible_to(sess: Session) -> str | None:
    """Whose dead letters a session may see and act on: its own key's, or (an operator) every key's (None)."""
    return None if sess.operator else sess.owner


def _retry(ctx, sess: Session, entry_id: str) -> tuple[str, str]:
    """Queue the dead letter's request again as a new job of this key (at this key's priority, as its completions
    are), then remove the dead letter."""
    dead = data.dead_letter(ctx, entry_id, _visible_to(sess))
    if dead is None:
        raise ValueError(f"dead letter {entry_id} is gone (deleted or retried already)")
    try:
        request = JobRequest.model_validate(json.loads(dead.letter.request))
    except (ValueError, TypeError) as err:
        raise ValueError(f"its request is not a valid job ({str(err)[:300]}); delete it instead") from None
    endpoint = "/v1/chat/completions" if request.messages else "/v1/completions"
    job_id = submit(ctx, sess.owner, endpoint, request).job_id  # its bytes counted as a completion's (429)
    ctx.redis.xdel(ctx.keys.dead, entry_id)
    return job_id, dead.letter.job_id


@router.post("/dead/{entry_id}/retry")
async def retry_dead(request: Request, sess: Acting,
                     entry_id: str = Path(pattern=ENTRY_ID)) -> Response:
    try:
        job_id, old = await run_in_threadpool(_retry, get_ctx(request), sess, entry_id)
    except (ValueError, TokenbusError, APIError) as err:  # APIError: past the key's byte limits (kept_bytes.py)
        return _notice(f"Not retried: {err}", ok=False)
    return HTMLResponse(f'<p role="status" class="notice ok">Queued again as '
                        f'<a href="/ui/jobs/{escape(job_id)}">{escape(job_id)}</a> (was {escape(old)}).</p>',
                        headers=HEADERS)


@router.post("/dead/{entry_id}/delete")
async def delete_dead(request: Request, sess: Acting,
                      entry_id: str = Path(pattern=ENTRY_ID)) -> Response:
    ctx = get_ctx(request)

    def delete() -> int:
        if data.dead_letter(ctx, entry_id, _visible_to(sess)) is None:
            return 0
        return ctx.redis.xdel(ctx.keys.dead, entry_id)

    removed = await run_in_threadpool(delete)
    return _notice("Deleted." if removed else "Already gone.", ok=bool(removed))
