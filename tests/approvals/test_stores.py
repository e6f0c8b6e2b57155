"""The approvals queue on SQLite and on the real PostgreSQL, through the conformance kit."""

from __future__ import annotations

from pathlib import Path

import pytest

from keel.settings import load_settings
from keel.stores import Backends, PostgresApprovalStore, SQLiteApprovalStore
from keel.testing.approvals_conformance import ApprovalStoreConformance, request


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
        assert backends.sql.schema_versions()["approvals"] == 1
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
