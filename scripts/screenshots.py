"""The docs' screenshots of the web viewer, made again from scratch: a real ``keel demo`` run,
``keel ui`` on its database, Debian's chromium through Playwright, 1,200 px wide.

    .venv/bin/python scripts/screenshots.py          # writes docs/viewer-*.png

It writes the run list, a run with a model step opened (what the model saw beside its output),
the run's timeline, the session page and the memory page (a search's hits)."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from playwright.sync_api import Page, sync_playwright

DOCS = Path(__file__).resolve().parent.parent / "docs"
WIDTH, HEIGHT = 1200, 760


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _shoot(page: Page, name: str, *, top: str | None = None, above: int = 12) -> None:
    """The page's first screen (from ``above`` pixels over ``top``, when given) into
    docs/viewer-NAME.png."""
    if top is not None:
        page.locator(top).first.evaluate(
            "(element, above) => { element.scrollIntoView(); window.scrollBy(0, -above); }",
            above,
        )
    target = DOCS / f"viewer-{name}.png"
    page.screenshot(path=str(target))
    print(f"wrote {target.relative_to(DOCS.parent)} ({target.stat().st_size:,} bytes)")


def _pages(url: str, key: str) -> None:
    chromium = shutil.which("chromium")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": WIDTH, "height": HEIGHT})
        page.goto(f"{url}/ui/login")
        page.get_by_label("API key").fill(key)
        page.get_by_role("button", name="Sign in").click()
        page.wait_for_url(re.compile(r".*/ui/runs$"))
        _shoot(page, "runs")
        page.goto(f"{url}/ui/runs?tool=book_flight")
        run = page.locator("a.run-link").first.get_attribute("href")
        page.goto(f"{url}{run}")
        step = page.locator("li.step.kind-model").nth(1)
        step.locator("summary").first.click()
        _shoot(page, "run", top="h2:has-text('Steps')")
        page.goto(f"{url}{run}/timeline")
        _shoot(page, "timeline")
        page.goto(f"{url}/ui/sessions/demo-session")
        # The turn a killed worker left open, and the run that resumed it.
        _shoot(page, "session", top="li.turn.status-interrupted", above=260)
        page.goto(f"{url}/ui/memory?user=demo-user&q=flight")
        _shoot(page, "memory")
        browser.close()


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="keel-screenshots-"))
    env = {**os.environ, "KEEL_DATA_DIR": str(work / "data"), "KEEL_EMBEDDER": "hashing:64"}
    keel = [sys.executable, "-m", "keel"]
    port = _free_port()
    try:
        demo = subprocess.run(
            [
                *keel,
                "demo",
                "--trips",
                "2",
                "--side-questions",
                "1",
                "--json",
                "--workdir",
                str(work),
            ],
            capture_output=True,
            text=True,
            env=env,
            check=True,
        )
        assert json.loads(demo.stdout.strip().splitlines()[-1])["passed"]
        database = f"sqlite:///{work / 'keel.db'}"
        viewer = subprocess.Popen(
            [*keel, "ui", "--database", database, "--port", str(port)],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        try:
            assert viewer.stdout is not None
            key = ""
            while not key:
                line = viewer.stdout.readline()
                assert line, "keel ui exited"
                found = re.search(r"(keel_\S+)$", line.strip())
                key = found.group(1) if found else ""
            url = f"http://127.0.0.1:{port}"
            for _ in range(300):
                try:
                    httpx.get(f"{url}/health", timeout=1)
                    break
                except httpx.HTTPError:
                    time.sleep(0.1)
            _pages(url, key)
        finally:
            viewer.terminate()
            viewer.communicate(timeout=30)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
