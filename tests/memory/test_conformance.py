from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from keel.stores import PostgresDatabase, PostgresMemoryStore, SQLiteDatabase, SQLiteMemoryStore
from keel.testing.memory_conformance import MemoryStoreConformance, StoreFactory


class TestSQLiteMemoryStore(MemoryStoreConformance):
    @pytest.fixture
    def make_store(self, tmp_path: Path) -> Iterator[StoreFactory]:
        # Each call opens the file again, as a restarted process would.
        with ExitStack() as databases:
            yield lambda: SQLiteMemoryStore(
                databases.enter_context(SQLiteDatabase(tmp_path / "memory.db"))
            )


@pytest.mark.postgres
class TestPostgresMemoryStore(MemoryStoreConformance):
    @pytest.fixture
    def make_store(self, postgres_url: str) -> Iterator[StoreFactory]:
        with ExitStack() as databases:
            yield lambda: PostgresMemoryStore(
                databases.enter_context(PostgresDatabase(postgres_url))
            )
