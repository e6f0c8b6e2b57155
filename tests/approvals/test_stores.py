"""The approvals queue on SQLite and on the real PostgreSQL, through the conformance kit."""

from __future__ import annotations

import contextlib
import json
import sqlite3
from pathlib import Path

import pytest

from keel.settings import load_settings
from keel.stores import Backends, PostgresApprovalStore, SQLiteApprovalStore
from keel.stores._migrations import MigrationSet
from keel.testing.approvals_conformance import REFUND_SCHEMA, ApprovalStoreConformance, request


class TestSQLiteApprovals(ApprovalStoreConformance):
    @pytest.fixture
    def approvals_database_url(self, tmp_path: Path) -> str:
        return f"sqlite:///{tmp_path / 'keel.db'}"


@pytest.mark.postgres
class TestPostgresApprovals(ApprovalStoreConformance):
    @pytest.fixture
    def approvals_database_url(self, postgres_url: str) -> str:
        return postgres_url


async def test_backends_open_the_sqlite_queue_in_the_same_file(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'keel.db'}"
    backends = Backends.open(load_settings(database=url), memory=False)
    try:
        assert isinstance(backends.approvals, SQLiteApprovalStore)
        assert backends.approvals.db is backends.sql
        await backends.approvals.aadd(request())
        assert backends.sql.schema_versions()["approvals"] == 2
    finally:
        await backends.aclose()


@pytest.mark.postgres
async def test_backends_open_the_postgres_queue_on_the_shared_pool(postgres_url: str) -> None:
    backends = Backends.open(load_settings(database=postgres_url), memory=False)
    try:
        assert isinstance(backends.approvals, PostgresApprovalStore)
        assert backends.approvals.database is backends.sql
        assert await backends.approvals.alist("acme") == []
    finally:
        await backends.aclose()


async def test_requests_made_before_the_schema_column_read_without_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from keel.stores import _sqlite_approvals

    url = f"sqlite:///{tmp_path / 'keel.db'}"
    current = _sqlite_approvals.APPROVAL_MIGRATIONS
    first = MigrationSet(current.component, current.migrations[:1])
    monkeypatch.setattr(_sqlite_approvals, "APPROVAL_MIGRATIONS", first)
    Backends.open(load_settings(database=url), memory=False).close()
    # A row as the first schema stored it, with no arguments_schema column.
    old = request("old", arguments_schema=None)
    row = {**old.model_dump(exclude={"decision", "arguments_schema"})}
    row["metadata"] = json.dumps(old.metadata)
    with contextlib.closing(sqlite3.connect(tmp_path / "keel.db")) as db, db:
        db.execute(
            f"INSERT INTO keel_approvals ({', '.join(row)}) VALUES ({', '.join('?' for _ in row)})",
            list(row.values()),
        )
    monkeypatch.setattr(_sqlite_approvals, "APPROVAL_MIGRATIONS", current)
    backends = Backends.open(load_settings(database=url), memory=False)
    try:
        assert backends.sql.schema_versions()["approvals"] == 2
        assert await backends.approvals.aget("acme", "old") == old
        made = await backends.approvals.aadd(request("new"))
        assert made.arguments_schema == REFUND_SCHEMA
    finally:
        await backends.aclose()
