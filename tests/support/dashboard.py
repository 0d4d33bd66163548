"""A dashboard session over real HTTP (httpx, no browser): the login form, its cookie, the CSRF token of a page,
the actions. What the dashboard's attack tests use against a `gateway serve` process."""

from __future__ import annotations

import re
from typing import Any

import httpx

TOKEN = re.compile(r'name="login_token" value="([^"]+)"')
CSRF = re.compile(r'"X-CSRF-Token": "([^"]+)"')


class Dashboard:
    def __init__(self, base_url: str, api_key: str, **client: Any) -> None:
        self.api_key = api_key
        self.http = httpx.Client(base_url=base_url, timeout=30, **client)

    def login(self) -> httpx.Response:
        """The login form, then its POST: 303 to /ui/ with a session cookie, or back to the login page."""
        form = self.http.get("/ui/login")
        token = TOKEN.search(form.text).group(1)
        return self.http.post("/ui/login", data={"api_key": self.api_key, "login_token": token})

    def logged_in(self) -> Dashboard:
        resp = self.login()
        assert resp.status_code == 303 and resp.headers["location"] == "/ui/", (resp.status_code, resp.headers)
        return self

    @property
    def session(self) -> str | None:
        return self.http.cookies.get("tb_session")

    def get(self, path: str, **kw: Any) -> httpx.Response:
        return self.http.get(path, **kw)

    def act(self, path: str, **kw: Any) -> httpx.Response:
        """An action as htmx sends it: a POST with the CSRF token of the overview page."""
        page = self.http.get("/ui/")
        csrf = CSRF.search(page.text)
        headers = {"x-csrf-token": csrf.group(1) if csrf else "", "hx-request": "true"} | kw.pop("headers", {})
        return self.http.post(path, headers=headers, **kw)

    def close(self) -> None:
        self.http.close()
