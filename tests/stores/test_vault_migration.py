"""A vault sealed before key checks were kept per master key (vault schema 1: one check row)
opens with its key after the upgrade, and still refuses another key."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from keel.errors import VaultKeyError
from keel.privacy import MasterKey
from keel.privacy._vault import _CHECK_PLAINTEXT, _owner
from keel.settings import Settings, load_settings
from keel.stores import Backends, SQLiteDatabase
from keel.stores._dialect import POSTGRES, SQLITE
from keel.stores._migrations import MigrationSet
from keel.stores._postgres import PostgresDatabase, apply_migrations
from keel.stores._sql_vault import vault_migrations


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def settings(request: pytest.FixtureRequest, tmp_path: Path) -> Settings:
    if request.param == "postgres":
        return load_settings(database=request.getfixturevalue("postgres_url"))
    return load_settings(data_dir=tmp_path)


def _seal_schema_one(settings: Settings, key: MasterKey) -> None:
    """The vault tables as schema 1 made them, with the one key check row of that key."""
    check = key.wrap(_CHECK_PLAINTEXT, _owner("", ""))
    row = "INSERT INTO keel_pii_key_check (id, wrapped, key_id, updated_at) VALUES (1, ?, ?, ?)"
    path = settings.sqlite_path
    if path is not None:
        first = MigrationSet("vault", vault_migrations(SQLITE).migrations[:1])
        with SQLiteDatabase(path) as db:
            db.setup(first)
            with db.transaction() as conn:
                conn.execute(row, (check, key.key_id, time.time()))
        return
    first = MigrationSet("vault", vault_migrations(POSTGRES).migrations[:1])
    database = PostgresDatabase(settings.parsed_database.url)
    try:
        with database.transaction() as conn:
            apply_migrations(conn, first)
            conn.execute(row.replace("?", "%s"), (check, key.key_id, time.time()))
    finally:
        database.close()


def test_a_schema_one_vault_opens_with_its_key_after_the_upgrade(settings: Settings) -> None:
    key = MasterKey.generate()
    _seal_schema_one(settings, key)
    with pytest.raises(VaultKeyError, match="not this vault's"):
        Backends.open(settings, memory=False, pii_key=MasterKey.generate())
    with Backends.open(settings, memory=False, pii_key=key) as backends:
        assert backends.vault is not None
        assert [check.key_id for check in backends.vault.store.key_checks()] == [key.key_id]
        placeholder = backends.vault.user("acme", "alice").placeholder("EMAIL", "a@example.org")
        assert backends.vault.user("acme", "alice").resolve(placeholder) == "a@example.org"
        if isinstance(backends.sql, SQLiteDatabase):
            assert backends.sql.schema_versions()["vault"] == 2
