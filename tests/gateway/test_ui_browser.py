"""The dashboard in a real browser (Debian's chromium, driven by Playwright) against the real stack: redis-server,
a worker on a tiny random-weight model, the gateway and its task process. One walk through every page:
log in, submit a batch and watch it reach 100 %, watch a job's tokens stream and cancel it, retry a dead letter,
log out and be refused. Screenshots of each page go to $TOKENBUS_UI_SCREENSHOTS (docs/ui/ holds the committed
ones) or the test's temp dir."""

from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path

import httpx
import pytest

from tests.support.gateway_harness import KEYS, chat_line, wait_until, write_jsonl
from tests.support.ui_stack import WORKER, launch_chromium, start_ui_stack, stop_ui_stack

pytestmark = pytest.mark.slow
playwright_api = pytest.importorskip("playwright.sync_api")
expect = playwright_api.expect


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = start_ui_stack(tmp_path_factory.mktemp("ui"))
    yield s
    stop_ui_stack(s)


def _shots(tmp_path: Path) -> Path:
    out = Path(os.environ.get("TOKENBUS_UI_SCREENSHOTS") or tmp_path / "shots")
    out.mkdir(parents=True, exist_ok=True)
    return out


def _stream_job(stack, got: dict) -> None:
    """A streamed chat completion long enough to watch (ignore_eos) and to cancel while it runs."""
    body = {"model": stack.model, "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": 3000, "ignore_eos": True, "temperature": 0.0, "stream": True}
    try:
        with httpx.stream("POST", stack.base_url + "/v1/chat/completions", json=body, timeout=120,
                          headers={"authorization": f"Bearer {KEYS['alice']}"}) as resp:
            got["job_id"] = resp.headers["x-tokenbus-job-id"]
            for _ in resp.iter_lines():
                pass
    except httpx.HTTPError as err:  # the stream ends with the cancel: only a failure to start matters
        got.setdefault("error", err)


def test_dashboard_in_chromium(stack, tmp_path):
    shots = _shots(tmp_path)
    r = stack.redis.client(decode_responses=True)
    with playwright_api.sync_playwright() as pw:
        browser = launch_chromium(pw)
        context = browser.new_context(base_url=stack.base_url, viewport={"width": 1280, "height": 820})
        page = context.new_page()
        page.set_default_timeout(30_000)

        # ---- log in: every page sends an anonymous browser to the login page -------------------------------
        page.goto("/ui/batches")
        expect(page).to_have_url(re.compile(r"/ui/login$"))
        page.screenshot(path=shots / "login.png")
        page.get_by_label("API key").fill(KEYS["alice"])
        page.keyboard.press("Enter")  # keyboard only
        expect(page.get_by_role("heading", name="Overview")).to_be_visible()
        page.keyboard.press("Tab")  # the first stop is the skip link, the next the navigation
        expect(page.get_by_role("link", name="Skip to content")).to_be_focused()
        page.keyboard.press("Tab")
        expect(page.get_by_role("link", name="Overview")).to_be_focused()
        expect(page.get_by_role("link", name="Overview")).to_have_attribute("aria-current", "page")
        cookie = next(c for c in context.cookies() if c["name"] == "tb_session")
        assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and KEYS["alice"] not in cookie["value"]

        # ---- submit a batch through the Batches page's form and watch it reach 100 % -----------------------
        lines = [chat_line(f"line-{i}", f"Say {i}.", model=stack.model, max_tokens=8) for i in range(6)]
        lines.append(chat_line("too-long", "x", model=stack.model, max_tokens=5000))  # fails: past the context
        src = write_jsonl(tmp_path / "batch.jsonl", lines)
        page.get_by_role("link", name="Batches").click()
        page.get_by_label("Batch input file (JSONL, OpenAI Batch format)").set_input_files(src)
        page.get_by_role("button", name="Submit batch").click()
        expect(page.get_by_role("heading", name=re.compile("^Batch batch_"))).to_be_visible()
        batch_id = page.url.rsplit("/", 1)[-1]
        expect(page.locator("#batch-percent")).to_have_text("100 %", timeout=90_000)
        expect(page.locator("#batch-status")).to_have_text("completed", timeout=30_000)
        expect(page.locator("#error-link")).to_be_visible()
        failed = page.locator("#failed-lines")  # the error file's lines, on the batch's page
        expect(failed.get_by_role("cell", name="too-long", exact=True)).to_be_visible()
        page.screenshot(path=shots / "batch.png", full_page=True)
        page.get_by_role("link", name="Batches").click()
        row = page.locator(f'tr[data-batch="{batch_id}"]')
        expect(row.locator(".pct")).to_have_text("100 %")
        page.screenshot(path=shots / "batches.png")

        # ---- a job's tokens streaming live, then cancel it ---------------------------------------------------
        got: dict = {}
        streamer = threading.Thread(target=_stream_job, args=(stack, got), daemon=True)
        streamer.start()
        job_id = wait_until(lambda: got.get("job_id"), 30, "the streamed job's id", stack.all())
        page.get_by_label("Job id").fill(job_id)
        page.get_by_role("button", name="Open job").click()
        tokens = page.locator("#tokens")
        # Several chunks arrive while the job still runs: the page shows them as they are generated.
        wait_until(lambda: int(tokens.get_attribute("data-chunks") or 0) >= 3, 60, "streamed chunks", stack.all())
        expect(page.locator("#job-status")).to_have_text("running")
        assert tokens.inner_text().strip()
        page.screenshot(path=shots / "job.png")
        page.get_by_role("button", name="Cancel job").click()
        expect(page.locator("#job-status")).to_have_text("cancelled", timeout=30_000)
        expect(tokens).to_have_attribute("data-done", "1", timeout=30_000)
        streamer.join(30)
        assert "error" not in got, got
        shown = tokens.inner_text()
        result = json.loads(r.hget(f"{{tokenbus}}:job:{job_id}", "result") or "{}")
        assert result.get("finish_reason") == "abort" and shown.strip() and result["text"].startswith(shown[:20])

        # ---- a dead letter: an entry with no job record (as a worker meets an expired job), then retry it ---
        request = json.dumps({"messages": [{"role": "user", "content": "again"}], "max_tokens": 4,
                              "model": stack.model})
        r.xadd("{tokenbus}:q:default", {"job_id": "ui-orphan-1", "request": request})
        wait_until(lambda: r.xlen("{tokenbus}:dead") >= 1, 30, "the dead letter", stack.all())
        page.get_by_role("link", name="Dead letters").click()
        expect(page.get_by_role("heading", name="Job ui-orphan-1")).to_be_visible()
        page.get_by_text("Payload").first.click()
        page.screenshot(path=shots / "dead.png", full_page=True)
        page.get_by_role("button", name="Retry dead letter ui-orphan-1").click()
        retried = page.get_by_role("status").get_by_role("link")
        expect(retried).to_be_visible()
        assert r.xlen("{tokenbus}:dead") == 0
        retried.click()
        expect(page.locator("#job-status")).to_have_text("finished", timeout=60_000)

        # ---- workers and overview (after the samples above) -------------------------------------------------
        page.get_by_role("link", name="Workers").click()
        worker_row = page.locator(f'tr[data-worker="{WORKER}"]')
        expect(worker_row).to_contain_text("on cpu")  # the heartbeat's backend on device
        expect(worker_row.locator("svg.spark")).to_be_visible()  # step times drawn
        page.screenshot(path=shots / "workers.png")
        page.get_by_role("link", name="Overview").click()
        expect(page.locator("#stat-workers")).to_have_text("1")
        wait_until(lambda: int(page.locator('[data-chart="depth"]').get_attribute("data-points") or 0) >= 2,
                   20, "two overview samples", stack.all())
        page.screenshot(path=shots / "overview.png")

        # ---- log out: the old session cookie is refused, pages go back to the login ------------------------
        page.get_by_role("button", name="Log out").click()
        expect(page).to_have_url(re.compile(r"/ui/login$"))
        page.goto("/ui/workers")
        expect(page).to_have_url(re.compile(r"/ui/login$"))
        old = httpx.get(stack.base_url + "/ui/workers", cookies={"tb_session": cookie["value"]},
                        follow_redirects=False)
        assert old.status_code in (303, 401) and "Workers" not in old.text
        browser.close()
