"""The viewer's approvals page in a real headless Chromium (Debian's ``chromium``, driven by
Playwright), against the service over real HTTP: the queue, then a rejection and a corrected
approval made through the page's forms, each resuming its turn."""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator

import pytest
from playwright.sync_api import Browser, sync_playwright

from tests.approvals.conftest import Approvals
from tests.approvals.test_http_decisions import _park


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise RuntimeError("chromium is not installed: ./setup.sh installs Debian's package")
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(
            executable_path=chromium, headless=True, args=["--no-sandbox"]
        )
        yield launched
        launched.close()


def test_an_operator_rejects_and_approves_from_the_page(
    browser: Browser, approvals: Approvals
) -> None:
    key = approvals.keys.create("acme")
    with approvals.client(key) as operator:
        rejected = _park(operator, "refund W1 900", session="s1")
        corrected = _park(operator, "refund W2 700", session="s2")
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(f"{approvals.url}/ui/approvals")
    page.get_by_label("API key").fill(key)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(re.compile(r".*/ui/approvals$"))
    assert page.locator("form.approval").count() == 2

    form = page.get_by_role("form", name=f"Decide {rejected}")
    form.get_by_label("reject").check()
    form.get_by_label("Note").fill("no receipt")
    form.get_by_role("button", name="Decide").click()
    notice = page.locator(".notice").inner_text()
    assert f"Rejected {rejected}" in notice and "rejected by operator:" in notice
    assert page.locator("form.approval").count() == 1

    form = page.get_by_role("form", name=f"Decide {corrected}")
    form.get_by_label("approve").check()
    form.get_by_label(re.compile("Corrected arguments")).fill('{"order": "W2", "amount": 300}')
    form.get_by_role("button", name="Decide").click()
    assert f"Approved {corrected}" in page.locator(".notice").inner_text()
    assert "No approvals pending" in page.locator("main").inner_text()
    page.close()
    assert approvals.effects == ["refund W2 300"]
