"""``keel ui`` as a user starts it on the embedded database: it prints a key that signs in, the
viewer answers, and the key is revoked however it stops (Ctrl-C, SIGTERM from a supervisor,
SIGHUP from a closed terminal)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from keel.testing.servers import free_port
from keel.ui import COOKIE


@pytest.mark.parametrize(
    "stop", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda stop: stop.name
)
def test_keel_ui_prints_a_key_that_signs_in_and_is_revoked_when_it_stops(
    tmp_path: Path, stop: signal.Signals
) -> None:
    env = {**os.environ, "KEEL_DATA_DIR": str(tmp_path), "KEEL_EMBEDDER": "hashing:64"}
    database = f"sqlite:///{tmp_path / 'keel.db'}"
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "keel", "ui", "--database", database, "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert process.stdout is not None
        key = ""
        while not key:
            line = process.stdout.readline()
            assert line, process.stderr.read() if process.stderr else "keel ui exited"
            found = re.search(r"(keel_\S+)$", line.strip())
            key = found.group(1) if found else ""
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"{url}/health", timeout=1)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "keel ui did not answer"
                time.sleep(0.1)
        with httpx.Client(base_url=url, timeout=30) as browser:
            signed = browser.post("/ui/login", data={"key": key}, follow_redirects=False)
            assert signed.status_code == 303 and COOKIE in signed.cookies
            runs = browser.get("/ui/runs")
            assert runs.status_code == 200 and "No runs match" in runs.text
    finally:
        process.send_signal(stop)
        _, errors = process.communicate(timeout=30)  # closes the pipes too
    listed = subprocess.run(
        [sys.executable, "-m", "keel", "keys", "list", "--database", database, "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=True,
    )
    assert [key["revoked"] for key in json.loads(listed.stdout)["keys"]] == [True]
    assert process.returncode == 0, (process.returncode, errors)
