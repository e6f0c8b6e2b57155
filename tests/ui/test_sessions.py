"""Signing in to the web viewer opens a server-side session: the browser's cookie is an opaque
token (never the key, nor any part of it), HttpOnly and SameSite, Secure behind https, with a
bounded lifetime; every worker on the database honours it; signing out, revoking the key and
the session's expiry each end it. Driven by a real headless Chromium against the service on
uvicorn, with the key store's clock injected (moved on, never waited for)."""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
from playwright.sync_api import Browser, Page

from keel.service._keys import key_id_of
from keel.ui import COOKIE
from tests.ui.conftest import Served


def _sign_in(browser: Browser, url: str, key: str) -> Page:
    page = browser.new_page()
    page.goto(f"{url}/ui/runs")
    assert "/ui/login" in page.url
    page.get_by_label("API key").fill(key)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(re.compile(r".*/ui/runs$"))
    return page


def _signed_out(page: Page, url: str) -> bool:
    """Whether the viewer sends this page's browser to sign in."""
    page.goto(f"{url}/ui/runs")
    return "/ui/login" in page.url


def test_the_cookie_is_an_opaque_session_every_worker_honours_until_sign_out(
    browser: Browser, served: Served
) -> None:
    key = served.keys.create("acme")
    key_id, secret = key.removeprefix("keel_").split("_", 1)
    first, second = served.urls
    page = _sign_in(browser, first, key)
    [cookie] = [c for c in page.context.cookies() if c["name"] == COOKIE]
    token = cookie["value"]
    assert token != key and key_id not in token and secret not in token
    assert not any(token[i : i + 8] in key for i in range(len(token) - 7)), "shares a part"
    assert cookie["httpOnly"] and cookie["sameSite"] in ("Strict", "Lax")
    assert not cookie["secure"], "served over http here: Secure would never be sent back"
    assert 0 < cookie["expires"] - time.time() <= 24 * 3600, "a bounded lifetime"
    with sqlite3.connect(served.database) as conn:
        stored = [row[0] for row in conn.execute("SELECT token_sha256 FROM keel_ui_sessions")]
    assert len(stored) == 1 and token not in stored[0], "only the token's hash is kept"

    # The other worker (same host, so the browser sends it the cookie) knows the session.
    assert not _signed_out(page, second)
    assert "acme" in page.locator("nav .tenant").inner_text()

    page.get_by_role("button", name="Sign out").click()
    page.wait_for_url(re.compile(r".*/ui/login"))
    # The session ended on the server: the old token, put back, signs nothing in.
    page.context.add_cookies([{**cookie}])
    assert _signed_out(page, first) and _signed_out(page, second)
    page.close()


def test_revoking_the_key_ends_its_sessions(
    browser: Browser, served: Served, tmp_path: Path
) -> None:
    key = served.keys.create("acme")
    page = _sign_in(browser, served.urls[0], key)
    revoked = subprocess.run(
        [
            *(sys.executable, "-m", "keel", "keys", "revoke", key_id_of(key) or ""),
            *("--database", f"sqlite:///{served.database}"),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "KEEL_DATA_DIR": str(tmp_path)},
        timeout=120,
        check=False,
    )
    assert revoked.returncode == 0, revoked.stderr
    assert _signed_out(page, served.urls[0]) and _signed_out(page, served.urls[1])
    page.close()


def test_an_expired_session_is_refused(browser: Browser, served: Served) -> None:
    signed_in_at = served.clock.now
    page = _sign_in(browser, served.urls[0], served.keys.create("acme"))
    [cookie] = [c for c in page.context.cookies() if c["name"] == COOKIE]
    lifetime = cookie["expires"] - time.time()  # what the browser was told, give or take
    served.clock.now = signed_in_at + lifetime - 60
    assert not _signed_out(page, served.urls[0]), "still within its lifetime"
    # The browser still sends the cookie (its own clock did not move): the server refuses it.
    served.clock.now = signed_in_at + lifetime + 120
    assert _signed_out(page, served.urls[0]), "past its lifetime"
    page.close()


def test_the_cookie_is_secure_behind_https(served: Served) -> None:
    key = served.keys.create("acme")
    with httpx.Client(base_url=served.urls[0], timeout=30) as client:
        # uvicorn trusts a proxy on 127.0.0.1 to say the client came over https.
        proxied = client.post(
            "/ui/login", data={"key": key}, headers={"X-Forwarded-Proto": "https"}
        )
        plain = client.post("/ui/login", data={"key": key})
    assert "secure" in proxied.headers["set-cookie"].lower().split("; ")
    assert "secure" not in plain.headers["set-cookie"].lower().split("; ")
    assert "httponly" in proxied.headers["set-cookie"].lower().split("; ")
