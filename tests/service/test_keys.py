"""API keys as the service's event loop checks them: the async look-up answers exactly as the
sync one on both databases, and a cached or async check never touches the sync path."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from keel.service import APIKeys
from keel.service._keys import CachedKeys
from keel.stores import PostgresDatabase, SQLiteDatabase


@pytest.fixture(params=["sqlite", "postgres"])
def keys(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[APIKeys]:
    if request.param == "sqlite":
        database: SQLiteDatabase | PostgresDatabase = SQLiteDatabase(tmp_path / "keys.db")
    else:
        database = PostgresDatabase(request.getfixturevalue("postgres_url"))
    with database:
        yield APIKeys(database)


def test_the_async_look_up_answers_as_the_sync_one(keys: APIKeys) -> None:
    acme = keys.create("acme")
    revoked = keys.create("globex")
    keys.revoke(revoked.split("_")[1])
    wrong_secret = acme[:-1] + ("A" if acme[-1] != "A" else "B")
    candidates = [acme, revoked, wrong_secret, "keel_nothex_x", "", "Bearer " + acme]

    async def both() -> list[tuple[str | None, str | None]]:
        answers = [(keys.tenant_of(key), await keys.atenant_of(key)) for key in candidates]
        if isinstance(keys.database, PostgresDatabase):
            await keys.database.aclose()
        return answers

    answers = asyncio.run(both())
    assert answers[0] == ("acme", "acme")
    assert all(sync == async_ for sync, async_ in answers)
    assert [async_ for _, async_ in answers[1:]] == [None] * 5


def test_a_cached_key_is_checked_on_the_loop_without_the_sync_look_up(keys: APIKeys) -> None:
    acme = keys.create("acme")
    sync_calls: list[str] = []

    def sync_look_up(key: str) -> str | None:
        sync_calls.append(key)
        return keys.tenant_of(key)

    cached = CachedKeys(sync_look_up, ttl_s=60.0, atenant_of_key=keys.atenant_of)

    async def check_twice() -> list[str | None]:
        answers = [await cached.acheck(acme), await cached.acheck(acme)]
        if isinstance(keys.database, PostgresDatabase):
            await keys.database.aclose()
        return answers

    assert asyncio.run(check_twice()) == ["acme", "acme"]
    # The service's requests must not open the sync pool (a connection of its own on a
    # worker's first request) nor hop to a thread for a key it verified a moment ago.
    assert sync_calls == []
    assert cached(acme) == "acme"
    assert sync_calls == []


def test_a_key_looked_up_while_its_user_is_erased_is_not_trusted_after(tmp_path: Path) -> None:
    # A request's look-up read the key just before the erasure deleted it, and finished just
    # after the worker dropped the user's cached keys: caching that answer then would trust
    # the erased user's key for the cache's whole life again.
    with SQLiteDatabase(tmp_path / "keys.db") as database:
        keys = APIKeys(database)
        own_key = keys.create("acme", "bob")
        looked_up = asyncio.Event()
        erased = asyncio.Event()

        async def look_up_then_wait(key: str) -> object:
            caller = await keys.acaller_of(key)
            looked_up.set()
            await erased.wait()
            return caller

        cached = CachedKeys(keys.caller_of, ttl_s=60.0, atenant_of_key=look_up_then_wait)

        async def erase_during_the_look_up() -> str | None:
            in_flight = asyncio.create_task(cached.acheck(own_key))
            await looked_up.wait()
            keys.erase_user("acme", "bob")
            cached.forget_user("acme", "bob")
            erased.set()
            await in_flight
            return await cached.acheck(own_key)

        assert asyncio.run(erase_during_the_look_up()) is None


def test_an_erasure_between_a_threads_check_and_its_keep_drops_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A sync look-up on a request's thread has checked that no erasure began since it read the
    # key; the erasure then runs whole on another thread before the look-up keeps its answer.
    # Kept, the erased user's key would be trusted for the cache's whole life.
    with SQLiteDatabase(tmp_path / "keys.db") as database:
        keys = APIKeys(database)
        own_key = keys.create("acme", "bob")
        cached = CachedKeys(keys.caller_of, ttl_s=60.0)
        checked, erased = threading.Event(), threading.Event()
        clock = time.monotonic

        def keeping_clock() -> float:
            # `_remember` reads the clock after its check, as it keeps the answer.
            keeping = sys._getframe(1).f_code.co_name == "_remember"
            if keeping and threading.current_thread().name == "request" and not checked.is_set():
                checked.set()
                erased.wait(timeout=2.0)  # the erasure cannot finish while the keep holds it
            return clock()

        def erase() -> None:
            checked.wait()
            keys.erase_user("acme", "bob")
            cached.forget_user("acme", "bob")
            erased.set()

        monkeypatch.setattr(time, "monotonic", keeping_clock)
        answers: list[str | None] = []
        request = threading.Thread(target=lambda: answers.append(cached(own_key)), name="request")
        eraser = threading.Thread(target=erase)
        request.start()
        eraser.start()
        request.join()
        eraser.join()
        assert answers == ["acme"]  # looked up before the erasure
        assert cached(own_key) is None
