"""The approvals queue on SQLite and on the real PostgreSQL, through the conformance kit."""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest

from keel.approvals import ApprovalDecision
from keel.settings import load_settings
from keel.stores import Backends, SQLApprovalStore
from keel.stores._dialect import SqlDialect
from keel.stores._migrations import MigrationSet
from keel.testing.approvals_conformance import REFUND_SCHEMA, ApprovalStoreConformance, request


def _first(
    count: int, migrations: Callable[[SqlDialect], MigrationSet]
) -> Callable[[SqlDialect], MigrationSet]:
    """The approvals migrations as a keel of an earlier schema had them: the first ``count``."""

    def earlier(dialect: SqlDialect) -> MigrationSet:
        every = migrations(dialect)
        return MigrationSet(every.component, every.migrations[:count])

    return earlier


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
        assert isinstance(backends.approvals, SQLApprovalStore)
        assert backends.approvals.db is backends.sql
        await backends.approvals.aadd(request())
        assert backends.sql.schema_versions()["approvals"] == 3
    finally:
        await backends.aclose()


@pytest.mark.postgres
async def test_backends_open_the_postgres_queue_on_the_shared_pool(postgres_url: str) -> None:
    backends = Backends.open(load_settings(database=postgres_url), memory=False)
    try:
        assert isinstance(backends.approvals, SQLApprovalStore)
        assert backends.approvals.db is backends.sql
        assert await backends.approvals.alist("acme") == []
    finally:
        await backends.aclose()


async def test_requests_made_before_the_schema_column_read_without_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from keel.stores import _sql_approvals

    url = f"sqlite:///{tmp_path / 'keel.db'}"
    current = _sql_approvals.approval_migrations
    monkeypatch.setattr(_sql_approvals, "approval_migrations", _first(1, current))
    Backends.open(load_settings(database=url), memory=False).close()
    # A row as the first schema stored it, with no arguments_schema column.
    old = request("old", arguments_schema=None)
    row = {**old.model_dump(exclude={"decision", "arguments_schema", "carried_out_at"})}
    row["metadata"] = json.dumps(old.metadata)
    with contextlib.closing(sqlite3.connect(tmp_path / "keel.db")) as db, db:
        db.execute(
            f"INSERT INTO keel_approvals ({', '.join(row)}) VALUES ({', '.join('?' for _ in row)})",
            list(row.values()),
        )
    monkeypatch.setattr(_sql_approvals, "approval_migrations", current)
    backends = Backends.open(load_settings(database=url), memory=False)
    try:
        assert backends.sql.schema_versions()["approvals"] == 3
        assert await backends.approvals.aget("acme", "old") == old
        made = await backends.approvals.aadd(request("new"))
        assert made.arguments_schema == REFUND_SCHEMA
    finally:
        await backends.aclose()


async def test_what_is_left_to_carry_out_is_read_through_its_own_index(tmp_path: Path) -> None:
    """The carrier's query reads the partial index of decided, not yet carried-out requests,
    not the tenant's whole history (SQLite's plan names the index)."""
    url = f"sqlite:///{tmp_path / 'keel.db'}"
    Backends.open(load_settings(database=url), memory=False).close()
    query = (
        "SELECT id FROM keel_approvals WHERE tenant_id = ? AND carried_out_at IS NULL "
        "AND status IN ('approved', 'rejected', 'expired') ORDER BY created_at, id LIMIT 10"
    )
    with contextlib.closing(sqlite3.connect(tmp_path / "keel.db")) as db:
        plan = " ".join(str(row) for row in db.execute(f"EXPLAIN QUERY PLAN {query}", ["a"]))
    assert "keel_approvals_to_carry_out" in plan, plan


async def test_requests_decided_before_the_upgrade_are_left_to_carry_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from keel.stores import _sql_approvals

    url = f"sqlite:///{tmp_path / 'keel.db'}"
    current = _sql_approvals.approval_migrations
    monkeypatch.setattr(_sql_approvals, "approval_migrations", _first(2, current))
    Backends.open(load_settings(database=url), memory=False).close()
    # A request decided under the second schema, with no carried_out_at column.
    decision = ApprovalDecision(approve=True, by="operator:olga", decided_at=1.0)
    old = request("old", status="approved", decision=decision)
    row = {**old.model_dump(exclude={"decision", "metadata", "arguments_schema", "carried_out_at"})}
    row.update(decision=decision.model_dump_json(), metadata="{}", arguments_schema=None)
    with contextlib.closing(sqlite3.connect(tmp_path / "keel.db")) as db, db:
        db.execute(
            f"INSERT INTO keel_approvals ({', '.join(row)}) VALUES ({', '.join('?' for _ in row)})",
            list(row.values()),
        )
    monkeypatch.setattr(_sql_approvals, "approval_migrations", current)
    backends = Backends.open(load_settings(database=url), memory=False)
    try:
        assert backends.sql.schema_versions()["approvals"] == 3
        # A carrier's first pass after the upgrade looks at it once (and marks it then).
        assert [r.id for r in await backends.approvals.alist_to_carry_out("acme")] == ["old"]
    finally:
        await backends.aclose()
