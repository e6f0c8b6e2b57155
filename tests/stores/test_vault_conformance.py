"""The vault store conformance suite on SQLite and on the real PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from keel.privacy import VaultStore
from keel.stores import PostgresDatabase, SQLiteDatabase, SQLiteVaultStore, SQLVaultStore
from keel.testing.vault_conformance import StoreFactory, VaultStoreConformance


class TestSQLiteVaultStore(VaultStoreConformance):
    @pytest.fixture
    def make_store(self, tmp_path: Path) -> Iterator[StoreFactory]:
        # Each call opens the file again, as a restarted process would.
        with ExitStack() as databases:
            yield lambda: SQLiteVaultStore(
                databases.enter_context(SQLiteDatabase(tmp_path / "vault.db"))
            )


@pytest.mark.postgres
class TestPostgresVaultStore(VaultStoreConformance):
    @pytest.fixture
    def make_store(self, postgres_url: str) -> Iterator[StoreFactory]:
        with ExitStack() as databases:
            yield lambda: SQLVaultStore(databases.enter_context(PostgresDatabase(postgres_url)))


class _OneByOneStore(SQLiteVaultStore):
    """A store without a batch of its own: ``VaultStore.add_values``'s default, one
    ``add_value`` after another."""

    add_values = VaultStore.add_values


class TestDefaultAddValues(VaultStoreConformance):
    @pytest.fixture
    def make_store(self, tmp_path: Path) -> Iterator[StoreFactory]:
        with ExitStack() as databases:
            yield lambda: _OneByOneStore(
                databases.enter_context(SQLiteDatabase(tmp_path / "vault.db"))
            )
