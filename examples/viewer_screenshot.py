"""The README's screenshot of the web viewer: a real ``keel demo`` run, ``keel ui`` on its
database, Debian's chromium through Playwright.

    .venv/bin/python examples/viewer_screenshot.py docs/viewer-runs.png
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from playwright.sync_api import sync_playwright


def main(target: Path) -> None:
    work = Path(tempfile.mkdtemp(prefix="keel-viewer-"))
    env = {**os.environ, "KEEL_DATA_DIR": str(work / "data")}
    keel = [sys.executable, "-m", "keel"]
    demo = subprocess.run(
        [*keel, "demo", "--trips", "3", "--workdir", str(work / "demo"), "--json"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    assert json.loads(demo.stdout.strip().splitlines()[-1])["passed"]
    database = f"sqlite:///{work / 'demo' / 'keel.db'}"
    viewer = subprocess.Popen(
        [*keel, "ui", "--database", database, "--port", "8765"],
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
        for _ in range(100):
            try:
                httpx.get("http://127.0.0.1:8765/health", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        chromium = shutil.which("chromium")
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1100, "height": 620})
            page.goto("http://127.0.0.1:8765/ui/login")
            page.get_by_label("API key").fill(key)
            page.get_by_role("button", name="Sign in").click()
            page.wait_for_url(re.compile(r".*/ui/runs$"))
            page.screenshot(path=str(target))
            browser.close()
    finally:
        viewer.terminate()
        viewer.communicate(timeout=30)
        shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {target} ({target.stat().st_size} bytes)")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/viewer-runs.png"))
