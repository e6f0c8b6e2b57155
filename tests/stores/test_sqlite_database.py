from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import pytest

from keel.errors import (
    ConfigError,
    DatabaseCorruptError,
    DatabaseLockedError,
    DataDirectoryError,
    SchemaVersionError,
)
from keel.stores import Migration, MigrationSet, SQLiteDatabase

WIDGETS = MigrationSet(
    "widgets",
    (
        Migration("widgets table", "CREATE TABLE widgets (id INTEGER PRIMARY KEY, name TEXT);"),
        Migration("widget colour", "ALTER TABLE widgets ADD COLUMN colour TEXT;"),
    ),
)


def test_setup_is_idempotent_and_records_versions(tmp_path: Path) -> None:
    db = SQLiteDatabase(tmp_path / "keel.db")
    assert db.setup(WIDGETS) == {"core": 1, "widgets": 2}
    assert db.setup(WIDGETS) == {"core": 1, "widgets": 2}
    with db.transaction() as conn:
        conn.execute("INSERT INTO widgets (name, colour) VALUES ('a', 'red')")
    db.close()
    reopened = SQLiteDatabase(tmp_path / "keel.db")
    assert reopened.setup(WIDGETS) == {"core": 1, "widgets": 2}
    assert reopened.connection().execute("SELECT count(*) FROM widgets").fetchone()[0] == 1
    reopened.close()


def test_later_migrations_apply_on_upgrade(tmp_path: Path) -> None:
    db = SQLiteDatabase(tmp_path / "keel.db")
    first_only = MigrationSet("widgets", WIDGETS.migrations[:1])
    assert db.setup(first_only)["widgets"] == 1
    assert db.setup(WIDGETS)["widgets"] == 2
    columns = [row[1] for row in db.connection().execute("PRAGMA table_info(widgets)")]
    assert columns == ["id", "name", "colour"]
    db.close()


def test_wal_busy_timeout_and_foreign_keys(tmp_path: Path) -> None:
    db = SQLiteDatabase(tmp_path / "keel.db", busy_timeout_ms=1234)
    conn = db.connection()
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("PRAGMA busy_timeout").fetchone()[0] == 1234
    assert conn.execute("PRAGMA foreign_keys").fetchone()[0] == 1
    db.close()


def test_newer_schema_is_a_clear_error(tmp_path: Path) -> None:
    db = SQLiteDatabase(tmp_path / "keel.db")
    db.setup(WIDGETS)
    db.close()
    older_code = MigrationSet("widgets", WIDGETS.migrations[:1])
    with pytest.raises(SchemaVersionError, match="newer than this keel knows"):
        SQLiteDatabase(tmp_path / "keel.db").setup(older_code)


def test_failed_migration_leaves_nothing_applied(tmp_path: Path) -> None:
    broken = MigrationSet(
        "broken",
        (
            Migration("ok", "CREATE TABLE first_table (id INTEGER);"),
            Migration("bad", "CREATE TABLE oops (;"),
        ),
    )
    db = SQLiteDatabase(tmp_path / "keel.db")
    with pytest.raises(Exception, match="syntax"):
        db.setup(broken)
    tables = {row[0] for row in db.connection().execute("SELECT name FROM sqlite_master")}
    assert "first_table" not in tables
    assert "broken" not in db.schema_versions()
    db.close()


def test_corrupt_file_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "keel.db"
    path.write_bytes(b"this is not a database at all" * 100)
    with pytest.raises(DatabaseCorruptError, match="not a SQLite database"):
        SQLiteDatabase(path).setup()


def test_locked_database_times_out_with_a_typed_error(tmp_path: Path) -> None:
    path = tmp_path / "keel.db"
    SQLiteDatabase(path).setup()
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        db = SQLiteDatabase(path, busy_timeout_ms=50)
        with pytest.raises(DatabaseLockedError, match="locked"), db.transaction() as conn:
            conn.execute("CREATE TABLE x (id INTEGER)")
        db.close()
    finally:
        holder.execute("ROLLBACK")
        holder.close()


def test_uncreatable_directory(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("a file where a directory should be")
    with pytest.raises(DataDirectoryError, match="cannot create data directory"):
        SQLiteDatabase(blocker / "sub" / "keel.db").setup()


def test_transaction_rolls_back_on_error(tmp_path: Path) -> None:
    db = SQLiteDatabase(tmp_path / "keel.db")
    db.setup(WIDGETS)
    with pytest.raises(RuntimeError), db.transaction() as conn:
        conn.execute("INSERT INTO widgets (name) VALUES ('ghost')")
        raise RuntimeError("boom")
    assert db.connection().execute("SELECT count(*) FROM widgets").fetchone()[0] == 0
    db.close()


def test_threads_write_concurrently_without_losing_rows(tmp_path: Path) -> None:
    db = SQLiteDatabase(tmp_path / "keel.db")
    db.setup(WIDGETS)

    def writer(n: int) -> None:
        for i in range(25):
            with db.transaction() as conn:
                conn.execute("INSERT INTO widgets (name) VALUES (?)", (f"{n}-{i}",))

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert db.connection().execute("SELECT count(*) FROM widgets").fetchone()[0] == 200
    db.close()


def test_a_sqlite_url_opens_the_file_it_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``sqlite:///PATH`` names PATH, as every URL keel takes does, never ``./sqlite:/PATH``."""
    monkeypatch.chdir(tmp_path)
    db = SQLiteDatabase(f"sqlite:///{tmp_path / 'keel.db'}")
    db.setup(WIDGETS)
    db.close()
    assert (tmp_path / "keel.db").is_file()
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("keel.db")) == []
    with pytest.raises(ConfigError, match="needs a file path"):
        SQLiteDatabase("sqlite:///")
