"""The web viewer's pages over real HTTP, without a browser: sign-in, tenant scoping on every
page, and the forms (revert, resolve) going through the same compare-and-set and journal."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import httpx

from keel.ui import COOKIE
from tests.service.conftest import Service

PAGES = ("/ui/runs", "/ui/memory?user=u1", "/ui/health", "/ui/sessions/s1")


@contextlib.contextmanager
def _browser(service: Service, key: str | None) -> Iterator[httpx.Client]:
    """A cookie-keeping client, signed in through the form with ``key`` (None: not)."""
    with httpx.Client(base_url=service.url, timeout=30, follow_redirects=False) as client:
        if key is not None:
            signed = client.post("/ui/login", data={"key": key, "next": "/ui/runs"})
            assert signed.status_code == 303 and signed.headers["location"] == "/ui/runs"
            assert COOKIE in signed.cookies
        yield client


def _turn(service: Service, key: str, session: str, text: str) -> None:
    with service.client(key) as api:
        reply = api.post(f"/v1/sessions/{session}/turns", json={"message": text, "user": "u1"})
        assert reply.status_code == 200, reply.text


def test_every_page_needs_a_signed_in_key(service: Service) -> None:
    with _browser(service, None) as anonymous:
        for path in PAGES:
            response = anonymous.get(path)
            assert response.status_code == 303, path
            assert response.headers["location"].startswith("/ui/login?next=")
        refused = anonymous.post("/ui/login", data={"key": "keel_000000000000_forged"})
        assert refused.status_code == 401 and "Unknown or revoked key" in refused.text
        anonymous.cookies.set(COOKIE, "keel_000000000000_forged", path="/ui")
        assert anonymous.get("/ui/runs").status_code == 303


def test_pages_show_only_the_keys_tenant(service: Service) -> None:
    acme, globex = service.keys.create("acme"), service.keys.create("globex")
    _turn(service, acme, "s1", "Book Oslo")
    with _browser(service, acme) as mine:
        runs = mine.get("/ui/runs")
        assert runs.status_code == 200 and "s1" in runs.text and "Book Oslo" in runs.text
        run_link = runs.text.split('class="run-link" href="', 1)[1].split('"', 1)[0]
        run = mine.get(run_link)
        assert run.status_code == 200 and "tool" in run.text and "trip to Oslo" in run.text
        session = mine.get("/ui/sessions/s1")
        assert session.status_code == 200 and "Checkpoints" in session.text
    with _browser(service, globex) as theirs:
        assert "Book Oslo" not in theirs.get("/ui/runs").text
        assert theirs.get(run_link).status_code == 404
        assert theirs.get("/ui/sessions/s1").status_code == 404
        assert theirs.get("/ui/sessions/s1?a=1&b=2").status_code == 404
        reverted = theirs.post(
            "/ui/sessions/s1/revert", data={"version": 1, "expected_version": 2, "confirm": "yes"}
        )
        assert reverted.status_code == 404
    with service.client(acme) as api:
        assert api.get("/v1/sessions/s1/checkpoints").json()[0]["reason"] != "revert"


def test_a_revert_is_confirmed_and_compare_and_set(service: Service) -> None:
    acme = service.keys.create("acme")
    _turn(service, acme, "s1", "Book Oslo")
    with service.client(acme) as api:
        version = api.get("/v1/sessions/s1").json()["version"]
    with _browser(service, acme) as page:
        unconfirmed = page.post(
            "/ui/sessions/s1/revert", data={"version": 1, "expected_version": version}
        )
        assert "Tick the confirmation" in unconfirmed.text
        stale = page.post(
            "/ui/sessions/s1/revert",
            data={"version": 1, "expected_version": version - 1, "confirm": "yes"},
        )
        assert "nothing was reverted" in stale.text
        with service.client(acme) as api:
            assert api.get("/v1/sessions/s1").json()["version"] == version
        done = page.post(
            "/ui/sessions/s1/revert",
            data={"version": 1, "expected_version": version, "confirm": "yes"},
        )
        assert f"the session is now at version {version + 1}" in done.text
        diff = page.get(f"/ui/sessions/s1?a=1&b={version}")
        assert 'class="diff"' in diff.text and "Book Oslo" in diff.text
    with service.client(acme) as api:
        assert api.get("/v1/sessions/s1").json()["version"] == version + 1


def test_an_in_doubt_call_is_shown_and_resolved_only_within_the_tenant(service: Service) -> None:
    from keel.runtime import session_key
    from keel.stores import SQLiteDatabase, SQLToolJournal

    acme, globex = service.keys.create("acme"), service.keys.create("globex")
    _turn(service, acme, "s1", "Book Oslo")
    database = SQLiteDatabase(service.database)
    journal = SQLToolJournal(database)
    journal.claim(
        key="k-9", session_id=session_key("acme", "s1"), step=7, call_index=0,
        tool="book", arguments='{"city": "Lima"}',
    )  # fmt: skip
    verdict = {"key": "k-9", "ok": "yes", "content": "booked Lima (checked with the agency)"}
    with _browser(service, globex) as theirs:
        assert theirs.post("/ui/sessions/s1/resolve", data=verdict).status_code == 404
    assert journal.in_doubt(session_key("acme", "s1"))
    with _browser(service, acme) as mine:
        shown = mine.get("/ui/sessions/s1")
        assert "Tools in doubt" in shown.text and "Lima" in shown.text
        resolved = mine.post("/ui/sessions/s1/resolve", data=verdict)
        assert resolved.status_code == 200 and "Resolved book call" in resolved.text
        assert "Tools in doubt" not in resolved.text
    entry = journal.get("k-9")
    assert entry is not None and entry.ok is True and not entry.in_doubt
    assert entry.content == "booked Lima (checked with the agency)"
    database.close()
