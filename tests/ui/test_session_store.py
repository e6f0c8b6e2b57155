"""The viewer's sessions where they are kept, next to the API keys, on both databases a
service runs on (every worker of ``keel serve --workers N`` reads them there): a session
speaks for its key until it expires, is ended, or its key is revoked; only the token's hash
is stored."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from keel.service import APIKeys
from keel.service._keys import key_id_of
from keel.stores import PostgresDatabase, SQLiteDatabase
from tests.ui.conftest import Clock


@pytest.fixture(params=["sqlite", "postgres"])
def database(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[SQLiteDatabase | PostgresDatabase]:
    if request.param == "sqlite":
        opened: SQLiteDatabase | PostgresDatabase = SQLiteDatabase(tmp_path / "keys.db")
    else:
        opened = PostgresDatabase(request.getfixturevalue("postgres_url"))
    with opened:
        yield opened


def test_a_session_lives_until_it_expires_ends_or_its_key_is_revoked(
    database: SQLiteDatabase | PostgresDatabase,
) -> None:
    clock = Clock(now=1_000_000.0)
    keys, other_worker = APIKeys(database, clock=clock), APIKeys(database, clock=clock)
    key = keys.create("acme")
    key_id = key_id_of(key) or ""
    expiring, ended, revoked = (keys.start_session(key_id, 3600) for _ in range(3))

    caller = other_worker.session_caller(expiring)
    assert caller is not None and (caller.tenant_id, caller.key_id) == ("acme", key_id)
    assert other_worker.session_caller(key) is None, "the key is no session token"

    other_worker.end_session(ended)
    assert keys.session_caller(ended) is None
    assert keys.session_caller(expiring) is not None

    clock.now += 3600
    assert keys.session_caller(expiring) is None, "expired"
    assert keys.session_caller(revoked) is None, "expired too"

    clock.now -= 3600
    assert keys.session_caller(revoked) is not None
    assert keys.revoke(key_id)
    assert other_worker.session_caller(revoked) is None
