"""A user's erasure on PostgreSQL (a real server), through the CLI and through the operator's
HTTP route: after real turns, every table of the database (``information_schema``) is read
back and holds nothing of the user, and the same user id in another tenant and their
neighbour keep everything."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from keel.privacy import MasterKey
from keel.service import APIKeys, build_service
from keel.settings import load_settings
from keel.stores import PostgresDatabase
from keel.testing import ScriptedModel
from tests.cli import keel_process
from tests.privacy._erasure_checks import assert_erased_only, assert_found_before
from tests.privacy._erasure_world import TENANT, USER, _policy, book, populate, refund, scan
from tests.service.conftest import serving


@pytest.fixture
def pii_key(monkeypatch: pytest.MonkeyPatch) -> str:
    key = MasterKey.new_key_text()
    monkeypatch.setenv("KEEL_PII_KEY", key)
    monkeypatch.setenv("KEEL_EMBEDDER", "hashing:64")
    return key


def test_the_cli_erases_the_user_from_every_table_on_postgres(
    postgres_url: str, pii_key: str
) -> None:
    populate(postgres_url, load_settings())
    with PostgresDatabase(postgres_url) as database:
        APIKeys(database).create(TENANT, USER)
    before = scan(postgres_url)
    assert_found_before(before)
    assert any(name.startswith("memory_vectors_") for name in before.tables)

    result = keel_process("users", "erase", TENANT, USER, "--database", postgres_url, "--json")
    assert result.returncode == 0, result.stderr
    # The approvals queue's async pool on keel's bridge loop was left open: its workers died
    # with the process, each printing "Task was destroyed but it is pending!".
    assert "Task was destroyed" not in result.stderr, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["removed"]["memory"]["memory_vectors"] >= 2
    assert_erased_only(before, scan(postgres_url), report)


def test_the_operator_route_erases_the_user_on_postgres(
    postgres_url: str, pii_key: str, tmp_path: Path
) -> None:
    settings = load_settings(data_dir=tmp_path)
    populate(postgres_url, settings)
    app, _, keys = build_service(
        postgres_url,
        model=ScriptedModel(_policy),
        tools=[book, refund],
        memory=True,
        settings=settings,
    )
    operator = keys.create(TENANT)
    keys.create(TENANT, USER)
    before = scan(postgres_url)
    assert_found_before(before)
    with serving(app) as running, httpx.Client(base_url=running.url, timeout=60) as client:
        answer = client.post(
            "/v1/privacy/erase",
            json={"user_id": USER},
            headers={"Authorization": f"Bearer {operator}"},
        )
        assert answer.status_code == 200, answer.text
    assert_erased_only(before, scan(postgres_url), answer.json())
