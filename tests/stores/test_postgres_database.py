"""PostgresDatabase: one pool shared by the PostgreSQL stores, psycopg errors translated."""

from __future__ import annotations

import time

import pytest

from keel.errors import BackendUnavailableError, DatabaseReadOnlyError
from keel.stores import PostgresDatabase, SQLStateBackend, SQLToolJournal
from keel.testing.servers import free_port

pytestmark = pytest.mark.postgres


def test_a_read_only_transaction_is_a_read_only_error(postgres_url: str) -> None:
    with PostgresDatabase(postgres_url, max_size=1) as database:
        with pytest.raises(DatabaseReadOnlyError), database.transaction() as conn:
            conn.execute("SET TRANSACTION READ ONLY")
            conn.execute("CREATE TABLE never_created (id INTEGER)")
        with database.connection() as conn:  # the connection went back to the pool usable
            assert conn.execute("SELECT to_regclass('never_created')").fetchone() == (None,)


def test_stores_share_a_database_and_leave_it_open(postgres_url: str) -> None:
    with PostgresDatabase(postgres_url, max_size=2) as database:
        state = SQLStateBackend(database)
        journal = SQLToolJournal(database)
        state.close()
        assert journal.entries() == []  # the shared pool outlives the stores
    with pytest.raises(BackendUnavailableError, match="closed"):
        journal.entries()


async def test_async_calls_use_the_running_loop_pool(postgres_url: str) -> None:
    database = PostgresDatabase(postgres_url, max_size=1)
    async with database.atransaction() as conn:
        cursor = await conn.execute("SELECT 1")
        assert await cursor.fetchone() == (1,)
    await database.aclose()
    with pytest.raises(BackendUnavailableError):
        async with database.aconnection():
            pass


async def test_a_server_that_refuses_fails_the_first_async_call_at_once_with_its_reason() -> None:
    url = f"postgresql://nobody@127.0.0.1:{free_port()}/x"
    database = PostgresDatabase(url)  # the pool's own wait: 30 s
    started = time.monotonic()
    with pytest.raises(BackendUnavailableError, match="Connection refused") as caught:
        async with database.aconnection():
            pass
    assert "\n" not in str(caught.value)  # libpq's hint joined to the line
    assert time.monotonic() - started < 15  # generous: about a second; it was 30
    # A later call tries again (a server down at start-up may be up by then), on a new pool.
    with pytest.raises(BackendUnavailableError, match="Connection refused"):
        async with database.aconnection():
            pass
    await database.aclose()
