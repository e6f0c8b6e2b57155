"""The PII vault's store: one class over a SQL database, SQLite or PostgreSQL alike
(component ``vault``).

Rows hold only what the vault hands down: wrapped data keys, HMAC tokens and sealed values,
never a key or a value in the clear. Each operation is a plan (``_sql_plan.py``), written once
over the database's `SqlDialect` and run by the database. What SQLite does beyond it (secure
delete, the write-ahead log's purge) is [`SQLiteVaultStore`][keel.stores.SQLiteVaultStore]'s.

``add_values`` (and ``add_value``, a batch of one) reads the user's key row with the
dialect's row lock (PostgreSQL ``FOR UPDATE``; SQLite's write transaction holds the whole
file), so a ``forget`` and the user's other writers wait for it: the key is compared once and
the next numbers counted in the same transaction that inserts the batch, four statements
whatever its size (the key, the tokens stored already, the entities' last numbers, one
multi-row insert). The insert is ``ON CONFLICT DO NOTHING`` and a row it leaves out is placed
again one by one, so a number is never taken twice even by a writer that holds no lock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from keel.errors import StoreError
from keel.privacy import StoredKey, VaultStore
from keel.stores._dialect import SqlDialect
from keel.stores._erase_sql import count_deleted
from keel.stores._migrations import Migration, MigrationSet
from keel.stores._sql_plan import Plan, SQLDatabase, Statement

__all__ = ["SQLVaultStore", "VaultCounts", "vault_migrations"]

_T = TypeVar("_T")

_ATTEMPTS = 16
"""Inserts tried before ``add_value`` gives up (each lost only to a writer that won)."""
_KEYS_PAGE = 500
"""Data keys read at a time by ``data_keys`` (a re-wrap runs between pages)."""


def vault_migrations(dialect: SqlDialect) -> MigrationSet:
    """The ``vault`` component's migrations in ``dialect``'s column types."""
    raw, real = dialect.bytes_type, dialect.real_type
    return MigrationSet(
        "vault",
        (
            Migration(
                "wrapped data keys per tenant and user, sealed values, the master key's check",
                f"""
                CREATE TABLE IF NOT EXISTS keel_pii_keys (
                    tenant_id TEXT NOT NULL,
                    user_id TEXT NOT NULL,
                    wrapped {raw} NOT NULL,
                    key_id TEXT NOT NULL,
                    created_at {real} NOT NULL,
                    PRIMARY KEY (tenant_id, user_id)
                );
                CREATE TABLE IF NOT EXISTS keel_pii_values (
                    tenant_id TEXT NOT NULL,
                    user_id TEXT NOT NULL,
                    entity TEXT NOT NULL,
                    number INTEGER NOT NULL,
                    token {raw},
                    sealed {raw},
                    created_at {real} NOT NULL,
                    PRIMARY KEY (tenant_id, user_id, entity, number),
                    UNIQUE (tenant_id, user_id, token)
                );
                CREATE TABLE IF NOT EXISTS keel_pii_key_check (
                    id INTEGER PRIMARY KEY CHECK (id = 1),
                    wrapped {raw} NOT NULL,
                    key_id TEXT NOT NULL,
                    updated_at {real} NOT NULL
                );
                """,
            ),
            Migration(
                "one key check per master key (a rotation under way accepts two), and the data "
                "keys found by the master key that wraps them",
                f"""
                CREATE TABLE IF NOT EXISTS keel_pii_key_checks (
                    key_id TEXT PRIMARY KEY,
                    wrapped {raw} NOT NULL,
                    created_at {real} NOT NULL
                );
                INSERT INTO keel_pii_key_checks (key_id, wrapped, created_at)
                    SELECT key_id, wrapped, updated_at FROM keel_pii_key_check;
                DROP TABLE keel_pii_key_check;
                CREATE INDEX IF NOT EXISTS keel_pii_keys_by_master_key ON keel_pii_keys (key_id);
                """,
            ),
        ),
    )


class SQLVaultStore(VaultStore):
    """The vault store in a SQL database (PostgreSQL's as it is; SQLite's through
    [`SQLiteVaultStore`][keel.stores.SQLiteVaultStore], which erases more); applies its
    migrations on construction.

    ``add_value`` on PostgreSQL locks the user's key row (``FOR UPDATE``), so two processes
    adding values for one user count numbers one after the other and a ``forget`` waits for a
    write in flight (or that write sees the key gone).

    Args:
        db: the database to share (the caller closes it).
    """

    def __init__(self, db: SQLDatabase) -> None:
        self.db = db
        db.migrate(vault_migrations(db.dialect))

    def _run_write(self, plan: Callable[[], Plan[_T]]) -> _T:
        """Run the write ``plan()`` in one transaction (an engine adds what it must)."""
        return self.db.run(plan)

    async def acall(self, call: Callable[[], _T]) -> _T:
        # The database's own rule: on SQLite inline unless it would wait for the write lock
        # (tens of microseconds on the local file), on PostgreSQL on keel's blocking pool.
        return await self.db.acall(call)

    # --- the master keys' checks ----------------------------------------------------------------

    def key_checks(self) -> list[StoredKey]:
        return self.db.run(_key_checks, write=False)

    def add_key_check(self, check: StoredKey) -> bool:
        params = (check.key_id, check.wrapped, time.time())
        return self._run_write(lambda: _changed(_ADD_CHECK, params))

    def drop_key_check(self, key_id: str) -> bool:
        return self._run_write(lambda: self._drop_key_check(key_id))

    def _drop_key_check(self, key_id: str) -> Plan[bool]:
        # The check's row locked first: a writer adding a data key under this master key holds
        # it shared until it commits, so the count below (a statement of its own, which sees
        # what committed before it) cannot miss that key.
        if not (yield Statement(_CHECK_OF + self.db.dialect.row_lock, (key_id,))).rows:
            return False
        if int((yield Statement(_WRAPPED_BY, (key_id,))).rows[0][0]):
            return False
        return (yield Statement(_DROP_CHECK, (key_id,))).rowcount == 1

    def wrapped_by(self, key_id: str) -> int:
        return self.db.run(lambda: _count(_WRAPPED_BY, (key_id,)), write=False)

    # --- data keys ------------------------------------------------------------------------------

    def data_key(self, tenant_id: str, user_id: str) -> StoredKey | None:
        return self.db.run(lambda: _one_key(_DATA_KEY, (tenant_id, user_id)), write=False)

    def add_data_key(self, tenant_id: str, user_id: str, key: StoredKey) -> StoredKey | None:
        return self._run_write(lambda: self._add_data_key(tenant_id, user_id, key))

    def _add_data_key(self, tenant_id: str, user_id: str, key: StoredKey) -> Plan[StoredKey | None]:
        share = " FOR SHARE" if self.db.dialect.row_lock else ""
        if not (yield Statement(_CHECK_OF + share, (key.key_id,))).rows:
            return None  # that master key is not (or no longer) the vault's
        params = (tenant_id, user_id, key.wrapped, key.key_id, time.time())
        rows = (yield Statement(_ADD_DATA_KEY, params)).rows
        if not rows:  # another writer's key stands (committed before our insert)
            rows = (yield Statement(_DATA_KEY, (tenant_id, user_id))).rows
        if not rows:  # pragma: no cover - present at the insert, gone by the read: a forget
            raise StoreError(f"the data key of {tenant_id}/{user_id} vanished while added")
        return _key(rows[0])

    def data_keys(self) -> Iterator[tuple[str, str, StoredKey]]:
        after: tuple[str, str] | None = None
        while True:
            page = self.db.run(partial(_keys_page, after), write=False)
            yield from page
            if len(page) < _KEYS_PAGE:
                return
            after = (page[-1][0], page[-1][1])

    def rewrap(self, tenant_id: str, user_id: str, old: StoredKey, new: StoredKey) -> bool:
        params = (new.wrapped, new.key_id, tenant_id, user_id, old.wrapped, old.key_id)
        return self._run_write(lambda: _changed(_REWRAP, params))

    # --- values ---------------------------------------------------------------------------------

    def numbers(
        self, tenant_id: str, user_id: str, tokens: Sequence[bytes]
    ) -> dict[bytes, tuple[str, int]]:
        return self.db.run(lambda: self._numbers(tenant_id, user_id, tokens), write=False)

    def _numbers(
        self, tenant_id: str, user_id: str, tokens: Sequence[bytes]
    ) -> Plan[dict[bytes, tuple[str, int]]]:
        found: dict[bytes, tuple[str, int]] = {}
        for batch in self.db.dialect.batches(list(dict.fromkeys(tokens))):
            condition, params = self.db.dialect.one_of("token", batch)
            sql = f"{_NUMBERS} AND {condition}"
            for token, entity, number in (yield Statement(sql, (tenant_id, user_id, *params))).rows:
                found[bytes(token)] = (str(entity), int(number))
        return found

    def add_value(
        self,
        tenant_id: str,
        user_id: str,
        entity: str,
        token: bytes,
        sealed: bytes,
        *,
        key: StoredKey,
    ) -> int | None:
        return self._run_write(
            lambda: self._add_value(tenant_id, user_id, entity, token, sealed, key)
        )

    def _add_value(
        self, tenant_id: str, user_id: str, entity: str, token: bytes, sealed: bytes, key: StoredKey
    ) -> Plan[int | None]:
        numbers = yield from self._add_values(tenant_id, user_id, [(entity, token, sealed)], key)
        return None if numbers is None else numbers[0]

    def add_values(
        self,
        tenant_id: str,
        user_id: str,
        values: Sequence[tuple[str, bytes, bytes]],
        *,
        key: StoredKey,
    ) -> list[int] | None:
        if not values:
            return []
        return self._run_write(lambda: self._add_values(tenant_id, user_id, values, key))

    def _add_values(
        self,
        tenant_id: str,
        user_id: str,
        values: Sequence[tuple[str, bytes, bytes]],
        key: StoredKey,
    ) -> Plan[list[int] | None]:
        owner = (tenant_id, user_id)
        rows = (yield Statement(_DATA_KEY + self.db.dialect.row_lock, owner)).rows
        if not rows or _key(rows[0]) != key:
            return None  # forgotten (or replaced) since the caller read it: store nothing
        # Tokens stored already (by this user's earlier call or a racing one) keep their
        # number; a token given twice in the batch is numbered once.
        stored = yield from self._numbers(tenant_id, user_id, [token for _, token, _ in values])
        numbered = {token: number for token, (_, number) in stored.items()}
        new: dict[bytes, tuple[str, bytes]] = {}
        for entity, token, sealed in values:
            if token not in numbered:
                new.setdefault(token, (entity, sealed))
        if not new:
            return [numbered[token] for _, token, _ in values]
        numbered.update((yield from self._insert_new(owner, new)))
        refused = [token for token in new if token not in numbered]
        if refused:
            # Lost to a writer that holds no lock (it stored the token, or took the number):
            # a token it stored keeps that number, the others are placed one by one under
            # their entity's next number, counted again.
            stored = yield from self._numbers(tenant_id, user_id, refused)
            numbered.update((token, number) for token, (_, number) in stored.items())
            recounted: dict[str, int] = {}
            for token in refused:
                if token not in numbered:
                    entity, sealed = new[token]
                    numbered[token] = yield from self._place(
                        owner, entity, token, sealed, recounted
                    )
        return [numbered[token] for _, token, _ in values]

    def _insert_new(
        self, owner: tuple[str, str], new: dict[bytes, tuple[str, bytes]]
    ) -> Plan[dict[bytes, int]]:
        """Insert ``token -> (entity, sealed)``, each under its entity's next number, in one
        statement (per few hundred parameters) after one read of the entities' last numbers;
        ``token -> number`` of those inserted (a row that conflicts is left out)."""
        entities = sorted({entity for entity, _ in new.values()})
        last = dict.fromkeys(entities, 0)
        condition, params = self.db.dialect.one_of("entity", entities)
        counted = yield Statement(
            f"{_LAST_NUMBERS} AND {condition} GROUP BY entity", (*owner, *params)
        )
        last.update((str(entity), int(number)) for entity, number in counted.rows)
        now = time.time()
        rows: list[tuple[Any, ...]] = []
        for token, (entity, sealed) in new.items():
            last[entity] += 1
            rows.append((*owner, entity, last[entity], token, sealed, now))
        inserted: dict[bytes, int] = {}
        size = self.db.dialect.most_values // len(_VALUE_COLUMNS) or len(rows)
        for start in range(0, len(rows), size):
            batch = rows[start : start + size]
            markers = ", ".join(_VALUE_ROW for _ in batch)
            result = yield Statement(
                _ADD_VALUES.format(rows=markers), tuple(part for row in batch for part in row)
            )
            inserted.update((bytes(token), int(number)) for token, number in result.rows)
        return inserted

    def _place(
        self,
        owner: tuple[str, str],
        entity: str,
        token: bytes,
        sealed: bytes,
        last: dict[str, int],
    ) -> Plan[int]:
        """Insert one new value under the entity's next number (``last``: the entity's last
        number as this transaction counted it, kept up to date)."""
        for attempt in range(_ATTEMPTS):
            if attempt:  # lost to a writer that holds no lock: it may have stored this token
                rows = (yield Statement(_NUMBER_OF_TOKEN, (*owner, token))).rows
                if rows:
                    return int(rows[0][0])
            if attempt or entity not in last:
                last[entity] = int((yield Statement(_LAST_NUMBER, (*owner, entity))).rows[0][0])
            params = (*owner, entity, last[entity] + 1, token, sealed, time.time())
            rows = (yield Statement(_ADD_VALUE, params)).rows
            if rows:
                last[entity] = int(rows[0][0])
                return last[entity]
        raise StoreError(
            f"no free {entity} number for {owner[0]}/{owner[1]} after {_ATTEMPTS} tries"
        )

    def sealed(
        self, tenant_id: str, user_id: str, refs: Sequence[tuple[str, int]]
    ) -> dict[tuple[str, int], tuple[bytes, bytes] | None]:
        return self.db.run(lambda: self._sealed(tenant_id, user_id, refs), write=False)

    def _sealed(
        self, tenant_id: str, user_id: str, refs: Sequence[tuple[str, int]]
    ) -> Plan[dict[tuple[str, int], tuple[bytes, bytes] | None]]:
        found: dict[tuple[str, int], tuple[bytes, bytes] | None] = {}
        unique = list(dict.fromkeys(refs))
        # Every (entity, number) in one statement (SQLite's parameter cap: two per ref).
        size = self.db.dialect.most_values // 2 or max(len(unique), 1)
        for start in range(0, len(unique), size):
            condition, params = _refs_condition(self.db.dialect, unique[start : start + size])
            result = yield Statement(f"{_SEALED} AND {condition}", (tenant_id, user_id, *params))
            for entity, number, token, sealed in result.rows:
                kept = token is not None and sealed is not None
                ref = (str(entity), int(number))
                found[ref] = (bytes(token), bytes(sealed)) if kept else None
        return found

    def forget(self, tenant_id: str, user_id: str) -> int:
        return self._run_write(lambda: _forget(tenant_id, user_id))

    def erase_user(self, tenant_id: str, user_id: str) -> dict[str, int]:
        return self._run_write(lambda: _erase_user(tenant_id, user_id))

    def counts(self) -> VaultCounts:
        """How many users have a data key, values are kept sealed, values were erased."""
        return self.db.run(_counts, write=False)


@dataclass(frozen=True)
class VaultCounts:
    """What a vault holds, in numbers only (``keel privacy status``)."""

    users: int
    values: int
    erased: int


_KEY_COLUMNS = "wrapped, key_id"
_CHECKS = f"SELECT {_KEY_COLUMNS} FROM keel_pii_key_checks ORDER BY created_at, key_id"
_ADD_CHECK = (
    "INSERT INTO keel_pii_key_checks (key_id, wrapped, created_at) VALUES (?, ?, ?) "
    "ON CONFLICT (key_id) DO NOTHING"
)
_CHECK_OF = "SELECT key_id FROM keel_pii_key_checks WHERE key_id = ?"
_DROP_CHECK = "DELETE FROM keel_pii_key_checks WHERE key_id = ?"
_WRAPPED_BY = "SELECT COUNT(*) FROM keel_pii_keys WHERE key_id = ?"
_OWNER = "tenant_id = ? AND user_id = ?"
_DATA_KEY = f"SELECT {_KEY_COLUMNS} FROM keel_pii_keys WHERE {_OWNER}"
_ADD_DATA_KEY = (
    "INSERT INTO keel_pii_keys (tenant_id, user_id, wrapped, key_id, created_at) "
    f"VALUES (?, ?, ?, ?, ?) ON CONFLICT (tenant_id, user_id) DO NOTHING RETURNING {_KEY_COLUMNS}"
)
_KEYS_FROM = f"SELECT tenant_id, user_id, {_KEY_COLUMNS} FROM keel_pii_keys"
_KEYS_ORDER = f" ORDER BY tenant_id, user_id LIMIT {_KEYS_PAGE}"
_REWRAP = (
    f"UPDATE keel_pii_keys SET wrapped = ?, key_id = ? WHERE {_OWNER} "
    "AND wrapped = ? AND key_id = ?"
)
_NUMBERS = f"SELECT token, entity, number FROM keel_pii_values WHERE {_OWNER}"
_NUMBER_OF_TOKEN = f"SELECT number FROM keel_pii_values WHERE {_OWNER} AND token = ?"
_LAST_NUMBER = f"SELECT COALESCE(MAX(number), 0) FROM keel_pii_values WHERE {_OWNER} AND entity = ?"
_LAST_NUMBERS = f"SELECT entity, MAX(number) FROM keel_pii_values WHERE {_OWNER}"
_VALUE_COLUMNS = ("tenant_id", "user_id", "entity", "number", "token", "sealed", "created_at")
_VALUE_ROW = f"({', '.join('?' for _ in _VALUE_COLUMNS)})"
_ADD_VALUES = (
    f"INSERT INTO keel_pii_values ({', '.join(_VALUE_COLUMNS)}) "
    "VALUES {rows} ON CONFLICT DO NOTHING RETURNING token, number"
)
_ADD_VALUE = (
    "INSERT INTO keel_pii_values (tenant_id, user_id, entity, number, token, sealed, created_at) "
    "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING RETURNING number"
)
_SEALED = f"SELECT entity, number, token, sealed FROM keel_pii_values WHERE {_OWNER}"
_COUNTS = (
    "SELECT (SELECT COUNT(*) FROM keel_pii_keys), "
    "(SELECT COUNT(*) FROM keel_pii_values WHERE sealed IS NOT NULL), "
    "(SELECT COUNT(*) FROM keel_pii_values WHERE sealed IS NULL)"
)
_FORGET_KEY = f"DELETE FROM keel_pii_keys WHERE {_OWNER}"
_FORGET_VALUES = (
    f"UPDATE keel_pii_values SET token = NULL, sealed = NULL WHERE {_OWNER} "
    "AND (token IS NOT NULL OR sealed IS NOT NULL)"
)


def _key(row: Sequence[Any]) -> StoredKey:
    return StoredKey(bytes(row[0]), str(row[1]))


def _refs_condition(
    dialect: SqlDialect, refs: Sequence[tuple[str, int]]
) -> tuple[str, tuple[Any, ...]]:
    """``(entity, number)`` equal to one of ``refs`` (not empty), with its parameters: two
    arrays unnested on PostgreSQL (one statement text whatever the count), a row-value list
    on SQLite."""
    if dialect.arrays:
        entities = [entity for entity, _ in refs]
        numbers = [number for _, number in refs]
        return _REFS_UNNEST, (entities, numbers)
    markers = ", ".join("(?, ?)" for _ in refs)
    return f"(entity, number) IN (VALUES {markers})", tuple(part for ref in refs for part in ref)


_REFS_UNNEST = "(entity, number) IN (SELECT * FROM unnest(?::text[], ?::integer[]))"


def _one_key(sql: str, params: tuple[Any, ...]) -> Plan[StoredKey | None]:
    rows = (yield Statement(sql, params)).rows
    return _key(rows[0]) if rows else None


def _key_checks() -> Plan[list[StoredKey]]:
    return [_key(row) for row in (yield Statement(_CHECKS)).rows]


def _count(sql: str, params: tuple[Any, ...]) -> Plan[int]:
    return int((yield Statement(sql, params)).rows[0][0])


def _changed(sql: str, params: tuple[Any, ...]) -> Plan[bool]:
    return (yield Statement(sql, params)).rowcount == 1


def _keys_page(after: tuple[str, str] | None) -> Plan[list[tuple[str, str, StoredKey]]]:
    if after is None:
        result = yield Statement(_KEYS_FROM + _KEYS_ORDER)
    else:
        # (tenant, user) after the last one read, spelled without row values.
        later = " WHERE tenant_id > ? OR (tenant_id = ? AND user_id > ?)"
        result = yield Statement(_KEYS_FROM + later + _KEYS_ORDER, (after[0], *after))
    return [
        (str(tenant), str(user), _key((wrapped, key_id)))
        for tenant, user, wrapped, key_id in result.rows
    ]


def _counts() -> Plan[VaultCounts]:
    row = (yield Statement(_COUNTS)).rows[0]
    return VaultCounts(*(int(count) for count in row))


def _forget(tenant_id: str, user_id: str) -> Plan[int]:
    yield Statement(_FORGET_KEY, (tenant_id, user_id))
    return (yield Statement(_FORGET_VALUES, (tenant_id, user_id))).rowcount


def _erase_user(tenant_id: str, user_id: str) -> Plan[dict[str, int]]:
    counts: dict[str, int] = {}
    params = (tenant_id, user_id)
    yield from count_deleted(counts, "pii_keys", _FORGET_KEY, params)
    values = f"DELETE FROM keel_pii_values WHERE {_OWNER}"
    yield from count_deleted(counts, "pii_values", values, params)
    return counts
