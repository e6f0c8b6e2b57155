"""A connection whose copy of the schema is older than the file's still writes: another
connection (a second worker, a newer keel migrating during a rolling upgrade, a table created
on first use) may change the schema at any time.

SQLite compiles a first DELETE of a memory record against a stale copy wrongly: the FTS5
index's trigger connects its virtual table, which runs SQL of its own, notices the change and
drops the schema mid-compile, and the ``ON DELETE CASCADE`` of the record's vectors and
outbox entry then finds no ``memory_records`` table (SQLITE_SCHEMA, "no such table"). Every
connection here has read the schema, and none has touched the full-text index, before the
change: the state the failing run's pool thread was in.
"""

from __future__ import annotations

from pathlib import Path

from keel.memory import Memory, Scope
from keel.settings import load_settings
from keel.stores import (
    Backends,
    Migration,
    MigrationSet,
    SQLiteDatabase,
    SQLiteMemoryStore,
)

SCOPE = Scope(tenant_id="acme", user_id="u1")

# What a newer keel (or the application) adds to the file while this one runs.
NEWER_SCHEMA = MigrationSet(
    "newer",
    (Migration("a table a newer release adds", "CREATE TABLE newer_notes (note TEXT)"),),
)


def test_a_record_is_forgotten_after_another_connection_changed_the_schema(
    tmp_path: Path,
) -> None:
    path = tmp_path / "keel.db"
    with SQLiteDatabase(path) as writer:
        # Another worker made the memory tables and wrote a record: this database never
        # touched the full-text index.
        with Memory(SQLiteMemoryStore(writer)) as other:
            record = other.add("My dog is called Rex", scope=SCOPE)
        with SQLiteDatabase(path) as database:
            store = SQLiteMemoryStore(database)
            store.setup()  # reads the schema: applied already
            assert store.count_pending(5) == 1  # the connection's copy of the schema is loaded
            writer.migrate(NEWER_SCHEMA)  # the other connection changes the schema
            assert store.delete(SCOPE, record.id)
            assert store.get(SCOPE, record.id) is None
            assert store.count_pending(5) == 0, "the cascade left the record's outbox entry"


def test_a_worker_forgets_a_memory_while_another_worker_migrates_the_file(
    tmp_path: Path,
) -> None:
    settings = load_settings(data_dir=tmp_path, embedder="hashing:64")
    url = f"sqlite:///{tmp_path / 'keel.db'}"
    with Backends.open(url, settings=settings, background=False) as first:
        assert first.memory is not None
        record = first.memory.add("My dog is called Rex", scope=SCOPE)
        with Backends.open(url, settings=settings, background=False) as serving:
            assert serving.memory is not None
            # The newer release's worker migrates while this one serves (a rolling upgrade).
            first.sql.migrate(NEWER_SCHEMA)
            assert serving.memory.forget(SCOPE, record.id)
            assert serving.memory.get(SCOPE, record.id) is None
