"""``DELETE /v1/memory/{id}`` while another process changes the database's schema (a newer
release's worker migrating during a rolling upgrade): 200, never 503.

The service forgets on keel's blocking pool. Each pool thread's connection here has read the
schema before the change and never touched the full-text index, as a pool thread that ran only
the outbox worker's reads has: SQLite then compiles the record's first DELETE against its stale
copy of the schema and fails ("no such table: memory_records", see
tests/stores/test_sqlite_schema_changes.py) unless the write transaction reloads it first.
"""

from __future__ import annotations

import threading

from keel._bridge import BLOCKING_THREADS, map_blocking
from keel.memory import Memory
from keel.stores import Migration, MigrationSet, SQLiteDatabase
from tests.service.conftest import Service


def _every_pool_thread_reads(memory: Memory) -> None:
    """Every thread of keel's blocking pool reads ``memory``'s outbox (its connection loads
    the schema); the calling thread is one lane more, and the barrier passes only once every
    pool thread runs one read."""
    lanes = BLOCKING_THREADS + 1
    together = threading.Barrier(lanes, timeout=60)

    def read(_: int) -> None:
        memory.pending()
        together.wait()

    map_blocking(read, range(lanes), width=lanes)


def test_memory_is_forgotten_while_another_process_migrates_the_database(
    memory_service: Service,
) -> None:
    service = memory_service
    memory = service.agents("acme").memory
    assert memory is not None
    with service.client(service.keys.create("acme")) as acme:
        added = acme.post("/v1/memory", json={"user": "u1", "text": "My dog is called Rex"})
        assert added.status_code == 201, added.text
        record = added.json()["id"]
        memory.flush()
        memory.indexer.stop()  # the worker's reads would refresh a pool thread's schema
        _every_pool_thread_reads(memory)
        with SQLiteDatabase(service.database) as newer:
            newer.migrate(
                MigrationSet("newer", (Migration("a newer table", "CREATE TABLE n (x TEXT)"),))
            )
        forgotten = acme.delete(f"/v1/memory/{record}", params={"user": "u1"})
        assert forgotten.status_code == 200, forgotten.text
        assert acme.get(f"/v1/memory/{record}", params={"user": "u1"}).status_code == 404
