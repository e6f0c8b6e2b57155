"""Backend behaviour beyond the conformance suite: native Redis TTLs, pooler-safe PostgreSQL."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from keel.errors import ConfigError, ConflictError, ExpiredError
from keel.state import StateStore
from keel.stores import (
    PostgresDatabase,
    RedisStateBackend,
    SQLStateBackend,
)
from keel.testing._state_models import CounterState
from keel.testing._state_worker import state_backend_at


@pytest.mark.redis
def test_redis_sessions_expire_natively_and_say_so(redis_url: str) -> None:
    import redis

    backend = RedisStateBackend(redis_url, tombstone_s=60)
    store = StateStore(backend, CounterState)
    written = time.monotonic()  # before any write: no TTL can have started earlier
    cp = store.create("short", CounterState(), ttl=1.0)
    store.update("short", {"counter": 1}, expected_version=cp.version)
    client = redis.Redis.from_url(redis_url)
    try:
        ttl_ms = client.pttl("keel:state:{short}:head")
        # Redis holds the TTL (never more than asked). It is still running unless this
        # process stalled past the whole second, when Redis may already have expired the key.
        assert ttl_ms <= 1000
        assert ttl_ms > 0 or time.monotonic() - written >= 1.0, ttl_ms
        deadline = time.monotonic() + 30
        while client.exists("keel:state:{short}:head", "keel:state:{short}:rows"):
            assert time.monotonic() < deadline, "Redis never expired the session"
            time.sleep(0.05)
        with pytest.raises(ExpiredError, match="expired"):
            store.get("short")
        assert store.vacuum().expired_sessions == ["short"]
        assert store.get("short") is None
        assert client.keys("keel:state:{short}*") == []
    finally:
        client.close()
        store.close()


@pytest.mark.postgres
def test_postgres_uses_no_server_side_prepared_statements(postgres_url: str) -> None:
    database = PostgresDatabase(postgres_url, max_size=1)
    backend = SQLStateBackend(database)
    store = StateStore(backend, CounterState)
    try:
        cp = store.create("s", CounterState())
        for _ in range(10):
            cp = store.update("s", {"counter": 1}, expected_version=cp.version)
            store.load("s")
        with backend.db.connection() as conn:
            count = conn.execute("SELECT count(*) FROM pg_prepared_statements").fetchone()
        assert count is not None and count[0] == 0
        assert store.load("s").state.counter == 10
    finally:
        store.close()
        database.close()


@pytest.mark.postgres
async def test_postgres_async_creators_racing_for_one_session_one_wins_one_conflicts(
    postgres_url: str,
) -> None:
    database = PostgresDatabase(postgres_url, max_size=4)
    store = StateStore(SQLStateBackend(database), CounterState)
    waiting = (
        "SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation "
        "WHERE c.relname = 'keel_state_sessions' AND NOT l.granted"
    )
    try:
        with database.transaction() as blocker:
            # Reads of the table go on; both creators' writes wait here, so both have looked
            # for the session before either creates it.
            blocker.execute("LOCK TABLE keel_state_sessions IN SHARE MODE")
            creates = [
                asyncio.create_task(store.acreate("race", CounterState(counter=n))) for n in (1, 2)
            ]
            deadline = time.monotonic() + 30
            with database.connection() as watcher:
                while watcher.execute(waiting).fetchone() != (2,):
                    assert time.monotonic() < deadline, "the creators never queued"
                    await asyncio.sleep(0.01)
        outcomes = await asyncio.gather(*creates, return_exceptions=True)
        assert sum(isinstance(outcome, ConflictError) for outcome in outcomes) == 1, outcomes
        won = next(outcome for outcome in outcomes if not isinstance(outcome, BaseException))
        assert store.load("race").state.counter == won.state.counter
    finally:
        store.close()
        await database.aclose()


def test_unknown_backend_url_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown state backend"):
        state_backend_at("mongodb://localhost")


def test_unreachable_servers_raise_backend_unavailable() -> None:
    from keel.errors import BackendUnavailableError
    from keel.testing.servers import free_port

    port = free_port()
    with pytest.raises(BackendUnavailableError, match="Redis"):
        RedisStateBackend(f"redis://127.0.0.1:{port}/0")
    database = PostgresDatabase(
        f"postgresql://keel:secret@127.0.0.1:{port}/keel?connect_timeout=1", timeout=1
    )
    with pytest.raises(BackendUnavailableError, match="PostgreSQL") as caught:
        SQLStateBackend(database)
    database.close()
    assert "secret" not in str(caught.value)


async def test_a_stale_append_on_sqlite_names_the_head_it_lost_to(tmp_path: Path) -> None:
    """The compare-and-set is the head's UPDATE; the head is read only when it fails, in the
    same transaction, and the conflict says which version won (two workers, one file)."""
    from keel.stores import SQLiteDatabase

    database = SQLiteDatabase(tmp_path / "state.db")
    one = StateStore(SQLStateBackend(database), CounterState)
    other = StateStore(SQLStateBackend(database), CounterState)
    try:
        first = (await one.acreate("s", CounterState(counter=1))).version
        assert other.load("s").version == first  # the other worker knows this version too
        won = await one.aappend(
            "s", {}, update={"counter": 2}, expected_version=first, reason="update"
        )
        with pytest.raises(ConflictError) as raised:
            await other.aappend(
                "s", {"items": ["late"]}, update={}, expected_version=first, reason="update"
            )
        assert (raised.value.expected, raised.value.actual) == (first, won)
        assert one.load("s").state == CounterState(counter=2)
    finally:
        one.close()
        other.close()
        database.close()
