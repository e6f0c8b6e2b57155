"""A memory store is given an open database to share, never a path or URL."""

from __future__ import annotations

from pathlib import Path

import pytest

from keel.errors import UsageError
from keel.stores import PostgresMemoryStore, SQLiteMemoryStore


def test_a_sqlite_memory_store_given_a_path_names_the_database_it_takes(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"takes a SQLiteDatabase, not a value of type PosixPath"):
        SQLiteMemoryStore(tmp_path / "memory.db")  # type: ignore[arg-type]
    assert not (tmp_path / "memory.db").exists()


def test_a_postgres_memory_store_given_a_url_never_repeats_it() -> None:
    url = "postgresql://keel:hunter2@db.example:5432/keel"
    with pytest.raises(
        UsageError, match=r"takes a PostgresDatabase, not a value of type str"
    ) as raised:
        PostgresMemoryStore(url)  # type: ignore[arg-type]
    assert "hunter2" not in str(raised.value)
