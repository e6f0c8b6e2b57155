"""The web trace viewer in a real headless Chromium (Debian's ``chromium``, driven by
Playwright through its executable path), against ``keel serve`` on a database a real
``keel demo`` run filled. Screenshots land in the test's temp directory."""

from __future__ import annotations

import re

import pytest
from playwright.sync_api import Browser, Page

from tests.ui.conftest import DemoViewer

pytestmark = pytest.mark.slow

DEMO_SESSION = "demo-session"
DEMO_USER = "demo-user"


Viewer = DemoViewer


@pytest.fixture(scope="module")
def viewer(demo_viewer: DemoViewer) -> DemoViewer:
    """The demo database and server the page tests share (tests/ui/conftest.py)."""
    return demo_viewer


def _signed_in(browser: Browser, viewer: Viewer, key: str, width: int = 1280) -> Page:
    page = browser.new_page(viewport={"width": width, "height": 800})
    page.goto(f"{viewer.url}/ui/runs")
    assert "/ui/login" in page.url, "an unsigned visitor must be sent to the sign-in form"
    page.get_by_label("API key").fill(key)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(re.compile(r".*/ui/runs$"))
    return page


def test_from_the_run_list_into_a_run_its_session_and_a_diff(
    browser: Browser, viewer: Viewer
) -> None:
    page = _signed_in(browser, viewer, viewer.key)
    viewer.shots.mkdir(exist_ok=True)
    rows = page.locator("table.runs tbody tr")
    assert rows.count() >= 10, "the demo's turns are runs"
    assert DEMO_SESSION in rows.first.inner_text()
    page.screenshot(path=str(viewer.shots / "runs.png"), full_page=True)

    # A run with a tool call: its model step shows the prompt's sections against the window.
    page.goto(f"{viewer.url}/ui/runs?min_steps=3")
    page.locator("a.run-link").first.click()
    page.wait_for_url(re.compile(r".*/ui/runs/[0-9a-f]+"))
    assert page.get_by_role("heading", name="Steps").is_visible()
    first = page.locator("li.step.kind-model").first
    assert not first.locator(".bar").is_visible(), "steps start folded"
    first.locator("summary").first.click()
    assert first.locator(".bar .seg.system").is_visible()
    assert first.locator(".bar .seg.reserve").is_visible()
    assert "Parsed action" in first.inner_text() and "book_flight" in first.inner_text()
    tool = page.locator("li.step.kind-tool").first
    tool.locator("summary").first.click()
    assert "Tool result (masked)" in tool.inner_text()
    page.screenshot(path=str(viewer.shots / "run.png"), full_page=True)

    # Its session: the workflow path, the checkpoints, a diff of two of them.
    page.get_by_role("link", name=DEMO_SESSION).first.click()
    page.wait_for_url(re.compile(rf".*/ui/sessions/{DEMO_SESSION}$"))
    assert page.locator("svg.graph .node.current").count() == 1
    versions = page.locator("table.checkpoints tbody tr")
    assert versions.count() >= 2
    page.locator("table.checkpoints tbody tr").nth(1).get_by_label(re.compile("diff from")).check()
    page.locator("table.checkpoints tbody tr").nth(0).get_by_label(re.compile("diff to")).check()
    page.get_by_role("button", name="Diff the two versions").click()
    # Per field since issue 49 (was one unified diff in a pre.diff, its lines span.add/.del).
    diff = page.locator("table.diff")
    assert diff.is_visible()
    assert diff.locator("ins").count() + diff.locator("del").count() > 0
    page.screenshot(path=str(viewer.shots / "session.png"), full_page=True)
    page.close()


def test_memory_search_shows_why_each_hit_ranked(browser: Browser, viewer: Viewer) -> None:
    page = _signed_in(browser, viewer, viewer.key)
    page.goto(f"{viewer.url}/ui/memory?user={DEMO_USER}")
    assert page.locator("table.records tbody tr").count() > 0
    page.get_by_label("Search").fill("flight")
    page.get_by_role("button", name="Search").click()
    hits = page.locator("ol.hits li")
    assert hits.count() > 0
    why = hits.first.inner_text()
    assert "keyword rank" in why and "vector rank" in why and "recency ×" in why
    assert page.locator("pre.packed").is_visible()
    page.goto(f"{viewer.url}/ui/health?since=all")
    assert page.locator("svg.chart").count() >= 2
    page.screenshot(path=str(viewer.shots / "health.png"), full_page=True)
    page.close()


def test_another_tenants_key_sees_none_of_it(browser: Browser, viewer: Viewer) -> None:
    mine = _signed_in(browser, viewer, viewer.key)
    run_url = mine.locator("a.run-link").first.get_attribute("href")
    mine.close()
    page = _signed_in(browser, viewer, viewer.other_key)
    assert "No runs match" in page.locator("main").inner_text()
    for path in (run_url, f"/ui/sessions/{DEMO_SESSION}", f"/ui/memory?user={DEMO_USER}"):
        response = page.goto(f"{viewer.url}{path}")
        text = page.locator("main").inner_text()
        assert DEMO_SESSION not in text or response.status == 404, path
        assert "No records" in text or response.status == 404, path
    page.close()


def test_a_revert_needs_confirmation_and_lands_as_a_new_version(
    browser: Browser, viewer: Viewer
) -> None:
    page = _signed_in(browser, viewer, viewer.key, width=390)  # a phone's width
    page.goto(f"{viewer.url}/ui/sessions/{DEMO_SESSION}")
    before = int(page.locator("dl.facts dd").first.inner_text())
    page.get_by_role("button", name="Revert").click()
    assert "Tick the confirmation" in page.locator(".notice").inner_text()
    assert int(page.locator("dl.facts dd").first.inner_text()) == before
    page.get_by_label(re.compile("I want to put this session back")).check()
    page.get_by_role("button", name="Revert").click()
    assert "Reverted to version" in page.locator(".notice").inner_text()
    assert int(page.locator("dl.facts dd").first.inner_text()) == before + 1
    page.close()


def test_a_forged_key_is_refused(browser: Browser, viewer: Viewer) -> None:
    page = browser.new_page()
    page.goto(f"{viewer.url}/ui/login")
    page.get_by_label("API key").fill("keel_000000000000_forged")
    page.get_by_role("button", name="Sign in").click()
    assert "Unknown or revoked key" in page.locator(".error").inner_text()
    page.goto(f"{viewer.url}/ui/runs")
    assert "/ui/login" in page.url
    page.close()
