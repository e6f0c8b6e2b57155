"""A run's page answers the short id the CLI prints (``keel runs list`` shows 12 characters)
and any unique prefix of at least 8, among the signed-in tenant's runs only; a prefix that
names several of them answers a page listing them. Over real HTTP, signed in through the form."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime

import httpx
import pytest

from keel.tracing import Run
from tests.ui.conftest import Served

MINE_A, MINE_B = "abcdef01" + "0" * 24, "abcdef01" + "1" * 24
MINE_C, THEIRS = "cafebabe" + "0" * 24, "cafebabe" + "1" * 24
THEIRS_ONLY = "deadbeef" + "0" * 24


def _run(run_id: str, tenant: str) -> Run:
    return Run(
        run_id=run_id,
        session_id=f"{tenant}/s1",
        tenant_id=tenant,
        started_at=datetime.now(UTC),
        input=f"question of run {run_id}",
    )


@pytest.fixture
def acme(served: Served) -> Iterator[httpx.Client]:
    for run_id, tenant in (
        (MINE_A, "acme"),
        (MINE_B, "acme"),
        (MINE_C, "acme"),
        (THEIRS, "globex"),
        (THEIRS_ONLY, "globex"),
    ):
        served.traces.start_run(_run(run_id, tenant))
    with httpx.Client(base_url=served.urls[0], timeout=30) as client:
        signed = client.post("/ui/login", data={"key": served.keys.create("acme")})
        assert signed.status_code == 303
        yield client


def test_the_short_id_the_cli_prints_opens_the_tenants_run_only(acme: httpx.Client) -> None:
    # MINE_C[:8] is THEIRS[:8] too: another tenant's run neither answers nor makes it ambiguous.
    for shown in (MINE_C[:12], MINE_C[:8], MINE_C):
        page = acme.get(f"/ui/runs/{shown}")
        assert page.status_code == 200, shown
        assert f"question of run {MINE_C}" in page.text, shown
    # Never another tenant's run, and not from fewer than 8 characters.
    for path in (THEIRS_ONLY[:12], THEIRS_ONLY, THEIRS[:12], MINE_C[:7], "0" * 12):
        page = acme.get(f"/ui/runs/{path}")
        assert page.status_code == 404, path
        assert "question of run" not in page.text, path


def test_an_ambiguous_prefix_lists_the_runs_it_matches(acme: httpx.Client) -> None:
    page = acme.get(f"/ui/runs/{MINE_A[:8]}")
    assert page.status_code == 300
    assert "matches 2 runs" in page.text and "give more characters" in page.text
    assert f'href="/ui/runs/{MINE_A}"' in page.text and f'href="/ui/runs/{MINE_B}"' in page.text
