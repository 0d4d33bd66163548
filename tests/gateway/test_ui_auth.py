"""The dashboard's access rules, in-process against a real redis-server (no worker needed): nothing but the
login page without a session, CSRF and Origin on every action, the read-only role, logout ends the session,
and no page ever shows an API key."""

from __future__ import annotations

import json
import re
import time

import pytest
from fastapi.testclient import TestClient

from gateway.app import create_app
from gateway.settings import GatewaySettings

ADMIN, VIEWER, OTHER = "sk-ui-admin-" + "a" * 20, "sk-ui-viewer-" + "v" * 20, "sk-ui-other-" + "o" * 20
PAGES = ["/ui", "/ui/", "/ui/?fragment=1", "/ui/batches", "/ui/batches?fragment=1", "/ui/batches/batch_x",
         "/ui/workers", "/ui/dead", "/ui/jobs?id=abc", "/ui/jobs/abc", "/ui/jobs/abc/tokens", "/ui/api/series",
         "/ui/files/file-x", "/ui/static/ui.js", "/ui/static/htmx-2.0.11.min.js"]


@pytest.fixture
def ui(redis_server, tmp_path):
    settings = GatewaySettings(api_keys=f"{ADMIN},{VIEWER},{OTHER}", ui_keys=f"{ADMIN},{VIEWER}",
                               ui_readonly_keys=VIEWER, ui_operator_keys=ADMIN, redis_url=redis_server.url,
                               files_dir=tmp_path / "files")
    with TestClient(create_app(settings), base_url="http://gw.test") as client:
        yield client, redis_server.client(decode_responses=True)


def login(client: TestClient, key: str):
    form = client.get("/ui/login")
    token = re.search(r'name="login_token" value="([^"]+)"', form.text).group(1)
    return client.post("/ui/login", data={"api_key": key, "login_token": token}, follow_redirects=False)


def csrf_of(client: TestClient) -> str:
    return re.search(r'"X-CSRF-Token": "([^"]+)"', client.get("/ui/").text).group(1)


def dead_letter(r) -> str:
    request = json.dumps({"prompt": "hi", "max_tokens": 3})
    return r.xadd("{tokenbus}:dead", {"job_id": "j-dead", "reason": "no job record", "attempts": 0,
                                    "request": request, "worker": "w1", "at": repr(time.time())})


def test_only_the_login_page_without_a_session(ui):
    client, _ = ui
    for path in PAGES:
        resp = client.get(path, headers={"accept": "text/html"}, follow_redirects=False)
        assert resp.status_code in (303, 401), path
        assert resp.status_code == 401 or resp.headers["location"] == "/ui/login", path
    frag = client.get("/ui/?fragment=1", headers={"hx-request": "true"})
    assert frag.status_code == 401 and frag.headers["hx-redirect"] == "/ui/login"
    page = client.get("/ui/login")
    assert page.status_code == 200 and 'type="password"' in page.text
    assert "default-src 'self'" in page.headers["content-security-policy"]


def test_login_sets_a_strict_httponly_cookie_and_refuses_bad_keys(ui):
    client, r = ui
    for bad in ("nope", OTHER):  # unknown, and an API key not allowed in the dashboard: the same answer
        resp = login(client, bad)
        assert resp.status_code == 303 and resp.headers["location"] == "/ui/login?error=refused"
    forged = client.post("/ui/login", data={"api_key": ADMIN, "login_token": "forged"}, follow_redirects=False)
    assert forged.headers["location"] == "/ui/login?error=expired" and "tb_session" not in forged.cookies
    resp = login(client, ADMIN)
    assert resp.status_code == 303 and resp.headers["location"] == "/ui/"
    cookie = resp.headers["set-cookie"].lower()
    assert "tb_session=" in cookie and "httponly" in cookie and "samesite=strict" in cookie and "path=/ui" in cookie
    dead_letter(r)
    for path in PAGES[:9]:
        page = client.get(path)
        assert page.status_code in (200, 404), path
        assert ADMIN not in page.text and VIEWER not in page.text, path  # no key is ever shown
    # Redis holds the session by the cookie's hash, never the key
    for key in r.scan_iter("{tokenbus}:gw:ui:session:*"):
        assert ADMIN not in json.dumps(r.hgetall(key))


def test_actions_need_csrf_same_origin_and_the_operator_role(ui):
    client, r = ui
    login(client, ADMIN)
    csrf = csrf_of(client)
    entry = dead_letter(r)
    assert client.post(f"/ui/dead/{entry}/delete").status_code == 403  # no token
    assert client.post(f"/ui/dead/{entry}/delete", headers={"x-csrf-token": "x" * 43}).status_code == 403
    evil = client.post(f"/ui/dead/{entry}/delete", headers={"x-csrf-token": csrf, "origin": "https://evil.test"})
    assert evil.status_code == 403 and r.xlen("{tokenbus}:dead") == 1
    ok = client.post(f"/ui/dead/{entry}/delete", headers={"x-csrf-token": csrf, "origin": "http://gw.test"})
    assert ok.status_code == 200 and "Deleted" in ok.text and r.xlen("{tokenbus}:dead") == 0

    viewer = TestClient(client.app, base_url="http://gw.test")
    login(viewer, VIEWER)
    entry = dead_letter(r)
    page = viewer.get("/ui/dead").text
    assert "Read-only" in page and "/retry" not in page and "Submit batch" not in viewer.get("/ui/batches").text
    refused = viewer.post(f"/ui/dead/{entry}/retry", headers={"x-csrf-token": csrf_of(viewer)})
    assert refused.status_code == 403 and r.xlen("{tokenbus}:dead") == 1


def test_retry_queues_the_request_again_as_the_operators_job(ui):
    client, r = ui
    login(client, ADMIN)
    entry = dead_letter(r)
    resp = client.post(f"/ui/dead/{entry}/retry", headers={"x-csrf-token": csrf_of(client)})
    job_id = re.search(r'href="/ui/jobs/([0-9a-f]+)"', resp.text).group(1)
    assert r.xlen("{tokenbus}:dead") == 0 and r.hget(f"{{tokenbus}}:job:{job_id}", "status") == "queued"
    assert client.get(f"/ui/jobs/{job_id}").status_code == 200  # recorded as this key's job
    again = client.post(f"/ui/dead/{entry}/retry", headers={"x-csrf-token": csrf_of(client)})
    assert "Not retried" in again.text  # gone: no second job


def test_logout_ends_the_session_everywhere(ui):
    client, _ = ui
    login(client, ADMIN)
    old = client.cookies.get("tb_session")
    csrf = csrf_of(client)
    assert client.post("/ui/logout", data={"csrf": "wrong"}).status_code == 403
    resp = client.post("/ui/logout", data={"csrf": csrf}, follow_redirects=False)
    assert resp.status_code == 303 and resp.headers["location"] == "/ui/login"
    replay = TestClient(client.app, base_url="http://gw.test", cookies={"tb_session": old})
    assert replay.get("/ui/workers", follow_redirects=False).status_code == 401
