from __future__ import annotations

from pathlib import Path

import pytest

from keel.stores import PostgresMemoryStore, SQLiteMemoryStore
from keel.testing.memory_conformance import MemoryStoreConformance, StoreFactory


class TestSQLiteMemoryStore(MemoryStoreConformance):
    @pytest.fixture
    def make_store(self, tmp_path: Path) -> StoreFactory:
        return lambda: SQLiteMemoryStore(tmp_path / "memory.db")


@pytest.mark.postgres
class TestPostgresMemoryStore(MemoryStoreConformance):
    @pytest.fixture
    def make_store(self, postgres_url: str) -> StoreFactory:
        return lambda: PostgresMemoryStore(postgres_url)
