"""API keys: each names one tenant and, optionally, one user; only a hash of its secret is
ever stored.

A **user key** (``keel keys create --tenant T --user U``) reaches only that user's sessions,
memory and runs. A **tenant-wide key** is an operator's: it reaches every user of its tenant,
and its reads of a user's data are logged (``keel.service.access``).

A key reads ``keel_<id>_<secret>``. ``create`` returns it once; the database keeps the id, the
tenant and the SHA-256 of the secret, so a leaked database reveals no usable key. ``tenant_of``
looks the id up and compares hashes in constant time. The same table and code run on the SQLite
file and on PostgreSQL, next to the agent's other stores.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from keel._bridge import run_blocking
from keel.errors import UsageError
from keel.stores import PostgresDatabase, SQLiteDatabase
from keel.stores._migrations import Migration, MigrationSet
from keel.stores._sql_plan import Plan, Statement

__all__ = ["APIKey", "APIKeys", "CachedKeys", "Caller", "bearer_key", "key_id_of"]

_T = TypeVar("_T")

_KEY = re.compile(r"keel_([0-9a-f]{12})_([A-Za-z0-9_-]{32,64})")

KEY_MIGRATIONS = MigrationSet(
    "service_keys",
    (
        Migration(
            "API keys (hashes only)",
            """
            CREATE TABLE IF NOT EXISTS keel_api_keys (
                key_id TEXT PRIMARY KEY,
                tenant_id TEXT NOT NULL,
                secret_sha256 TEXT NOT NULL,
                created_at DOUBLE PRECISION NOT NULL,
                revoked_at DOUBLE PRECISION
            );
            CREATE INDEX IF NOT EXISTS keel_api_keys_tenant ON keel_api_keys (tenant_id);
            """,
        ),
        Migration(
            "API keys of one user (NULL: the tenant's operator)",
            "ALTER TABLE keel_api_keys ADD COLUMN user_id TEXT;",
        ),
        Migration(
            "The web viewer's sign-in sessions (hashes of their tokens only)",
            """
            CREATE TABLE IF NOT EXISTS keel_ui_sessions (
                token_sha256 TEXT PRIMARY KEY,
                key_id TEXT NOT NULL,
                created_at DOUBLE PRECISION NOT NULL,
                expires_at DOUBLE PRECISION NOT NULL
            );
            CREATE INDEX IF NOT EXISTS keel_ui_sessions_key ON keel_ui_sessions (key_id);
            """,
        ),
    ),
)


@dataclass(frozen=True)
class APIKey:
    """A key as stored: no secret."""

    key_id: str
    tenant_id: str
    created_at: float
    revoked: bool
    user_id: str | None = None
    """The one user the key acts for; None for a tenant-wide (operator) key."""

    @property
    def scope(self) -> str:
        """``operator`` for a tenant-wide key, ``user:<id>`` for a user's key."""
        return "operator" if self.user_id is None else f"user:{self.user_id}"


@dataclass(frozen=True)
class Caller:
    """Who a verified key speaks for: its tenant and, for a user key, its user."""

    tenant_id: str
    user_id: str | None = None
    key_id: str = ""

    @property
    def operator(self) -> bool:
        """A tenant-wide key: it reaches every user of the tenant."""
        return self.user_id is None


_LIVE_KEY = (
    "SELECT tenant_id, secret_sha256, user_id FROM keel_api_keys "
    "WHERE key_id = ? AND revoked_at IS NULL"
)

_LIVE_SESSION = (
    "SELECT k.tenant_id, k.user_id, k.key_id FROM keel_ui_sessions s "
    "JOIN keel_api_keys k ON k.key_id = s.key_id "
    "WHERE s.token_sha256 = ? AND s.expires_at > ? AND k.revoked_at IS NULL"
)
"""A session's caller: only while the session has not expired and its key is not revoked."""


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def _parsed(key: object) -> tuple[str, str] | None:
    """A well-formed key's id and secret."""
    found = _KEY.fullmatch(key.strip()) if isinstance(key, str) else None
    return None if found is None else (found[1], found[2])


def bearer_key(authorization: str | None) -> str | None:
    """The key an ``Authorization`` header carries, however it is spelled: the scheme in any
    case, any whitespace around and between (``bearer KEY``, ``BEARER\tKEY``,
    ``Bearer  KEY ``); None when the header is not one bearer token."""
    parts = (authorization or "").split()
    if len(parts) != 2 or parts[0].lower() != "bearer":
        return None
    return parts[1]


def key_id_of(key: str) -> str | None:
    """A well-formed key's id (what a key is counted by: the same key however it was sent)."""
    parsed = _parsed(key)
    return None if parsed is None else parsed[0]


def _verified(rows: list[tuple[Any, ...]], key_id: str, secret: str) -> Caller | None:
    """Who the key row found speaks for, if the secret's hash matches (in constant time)."""
    if not rows:
        return None
    tenant_id, stored, user_id = rows[0]
    if not hmac.compare_digest(str(stored), _digest(secret)):
        return None
    return Caller(str(tenant_id), None if user_id is None else str(user_id), key_id)


class APIKeys:
    """The service's API keys, on the agent's SQL database (SQLite or PostgreSQL), and the
    sign-in sessions of the web viewer, which a key opens.

    A viewer session is an opaque random token (the browser's cookie), stored as its SHA-256
    with an expiry next to the keys, so that every worker of a service sees it: it speaks for
    its key while the key is live and the session has not expired (or been ended). ``clock``:
    the time in seconds since the epoch (a test moves it on instead of waiting)."""

    def __init__(
        self, database: SQLiteDatabase | PostgresDatabase, *, clock: Callable[[], float] = time.time
    ) -> None:
        self.database = database
        self._clock = clock
        database.migrate(KEY_MIGRATIONS)

    def _execute(self, statement: str, parameters: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        """One write, in a transaction of its own: the rows it returns."""
        return self.database.run(lambda: _rows(Statement(statement, parameters)))

    def _query(self, statement: str, parameters: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        """One read: its rows."""
        return self.database.run(lambda: _rows(Statement(statement, parameters)), write=False)

    def create(self, tenant_id: str, user_id: str | None = None) -> str:
        """A new key for ``tenant_id`` (only ``user_id``'s data when given; the tenant's
        operator key otherwise): the only time its secret is seen."""
        for name, value in (("tenant", tenant_id), ("user", user_id)):
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise UsageError(f"a key's {name} must be non-blank text")
        key_id, secret = secrets.token_hex(6), secrets.token_urlsafe(32)
        self._execute(
            "INSERT INTO keel_api_keys (key_id, tenant_id, secret_sha256, created_at, user_id) "
            "VALUES (?, ?, ?, ?, ?)",
            (key_id, tenant_id, _digest(secret), self._clock(), user_id),
        )
        return f"keel_{key_id}_{secret}"

    def caller_of(self, key: str) -> Caller | None:
        """Who a valid, unrevoked key speaks for; None for anything else."""
        parsed = _parsed(key)
        if parsed is None:
            return None
        key_id, secret = parsed
        return _verified(self._query(_LIVE_KEY, (key_id,)), key_id, secret)

    def tenant_of(self, key: str) -> str | None:
        """The tenant a valid, unrevoked key belongs to; None for anything else."""
        caller = self.caller_of(key)
        return None if caller is None else caller.tenant_id

    async def acaller_of(self, key: str) -> Caller | None:
        """[`caller_of`][] for an event loop. On PostgreSQL it reads on the async pool the
        agent's stores use (already open when the server is ready), not on the sync one: a
        worker's first request would otherwise open a connection of its own."""
        parsed = _parsed(key)
        if parsed is None:
            return None
        key_id, secret = parsed
        read = Statement(_LIVE_KEY, (key_id,))
        return _verified(await self.database.arun(lambda: _rows(read), write=False), key_id, secret)

    async def atenant_of(self, key: str) -> str | None:
        """[`tenant_of`][] for an event loop."""
        caller = await self.acaller_of(key)
        return None if caller is None else caller.tenant_id

    def revoke(self, key_id: str) -> bool:
        """Revoke a key by its id (its viewer sessions end with it); False when there is no
        such live key."""
        rows = self._execute(
            "UPDATE keel_api_keys SET revoked_at = ? WHERE key_id = ? AND revoked_at IS NULL "
            "RETURNING key_id",
            (self._clock(), key_id),
        )
        self._execute("DELETE FROM keel_ui_sessions WHERE key_id = ?", (key_id,))
        return bool(rows)

    def erase_user(self, tenant_id: str, user_id: str) -> dict[str, int]:
        """Delete the user's keys (of ``tenant_id`` only) and their viewer sessions: a user's
        erasure (`keel.stores.erase_user`'s ``extra``); what was removed, by table."""
        return self.database.run(lambda: _erase_user(tenant_id, user_id))

    def start_session(self, key_id: str, lifetime_s: float) -> str:
        """A new viewer session for the key ``key_id`` (verified by the caller), ending after
        ``lifetime_s`` seconds: its token, the only time it is seen (only its hash is kept).
        Expired sessions are cleared here, so that the table holds the live ones only."""
        token = secrets.token_urlsafe(32)
        now = self._clock()
        self._execute("DELETE FROM keel_ui_sessions WHERE expires_at <= ?", (now,))
        self._execute(
            "INSERT INTO keel_ui_sessions (token_sha256, key_id, created_at, expires_at) "
            "VALUES (?, ?, ?, ?)",
            (_digest(token), key_id, now, now + lifetime_s),
        )
        return token

    def session_caller(self, token: str) -> Caller | None:
        """Who a viewer session speaks for: its key's caller, while the session has not
        expired or ended and its key is not revoked; None otherwise."""
        rows = self._query(_LIVE_SESSION, (_digest(token), self._clock()))
        if not rows:
            return None
        tenant_id, user_id, key_id = rows[0]
        return Caller(str(tenant_id), _text_or_none(user_id), str(key_id))

    def end_session(self, token: str) -> None:
        """End a viewer session (signing out): its token answers nothing from now on."""
        self._execute("DELETE FROM keel_ui_sessions WHERE token_sha256 = ?", (_digest(token),))

    async def acall(self, call: Callable[[], _T]) -> _T:
        """``call`` (one of these methods) for an event loop, as the database runs a blocking
        call: on SQLite inline unless it would wait, on PostgreSQL on keel's blocking pool."""
        return await self.database.acall(call)

    def list(self, tenant_id: str | None = None) -> list[APIKey]:
        """The keys (of one tenant, or all), newest first; never their secrets."""
        where, parameters = ("WHERE tenant_id = ?", (tenant_id,)) if tenant_id else ("", ())
        rows = self._query(
            "SELECT key_id, tenant_id, created_at, revoked_at, user_id FROM keel_api_keys "
            f"{where} ORDER BY created_at DESC",
            parameters,
        )
        return [
            APIKey(str(r[0]), str(r[1]), float(r[2]), r[3] is not None, _text_or_none(r[4]))
            for r in rows
        ]


def _text_or_none(value: object) -> str | None:
    return None if value is None else str(value)


_Found = Caller | str | None
"""What a key look-up answers: who the key speaks for (a bare tenant: its operator key)."""


def _as_caller(found: _Found) -> Caller | None:
    return Caller(found) if isinstance(found, str) else found


class CachedKeys:
    """``tenant_of_key`` with each verified key trusted for ``ttl_s`` seconds without a look-up
    (a revoked key stops working within that time): what every front door of the service (the
    API, the viewer, the MCP server) checks keys with. The look-up answers a `Caller`
    ([`APIKeys.caller_of`][]) or a bare tenant (an operator key)."""

    def __init__(
        self,
        tenant_of_key: Callable[[str], _Found],
        ttl_s: float = 30.0,
        atenant_of_key: Callable[[str], Awaitable[_Found]] | None = None,
    ) -> None:
        self._tenant_of_key = tenant_of_key
        self._atenant_of_key = atenant_of_key or (lambda key: run_blocking(tenant_of_key, key))
        self._ttl_s = ttl_s
        self._verified: dict[str, tuple[Caller, float]] = {}
        # Bumped by each `forget_user`: a look-up that began before it may have read a key the
        # erasure deleted, and its answer is not kept.
        self._forgets = 0
        # Checks run on threads (the sync look-up) beside an erasure's `forget_user`: the
        # bump-and-drop and the check-then-keep must not interleave, or a look-up that checked
        # before the bump keeps the erased key after it.
        self._lock = threading.Lock()

    def __call__(self, key: str) -> str | None:
        """The key's tenant, or None for an unknown or revoked key."""
        caller = self.caller(key)
        return None if caller is None else caller.tenant_id

    def operator_tenant(self, key: str) -> str | None:
        """The tenant of an operator (tenant-wide) key; None for any other key."""
        caller = self.caller(key)
        return None if caller is None or not caller.operator else caller.tenant_id

    def caller(self, key: str) -> Caller | None:
        """Who the key speaks for, or None for an unknown or revoked key."""
        fingerprint, cached = self._cached(key)
        if cached is not None:
            return cached
        forgets = self._forgets
        return self._remember(fingerprint, _as_caller(self._tenant_of_key(key)), forgets)

    async def acheck(self, key: str) -> str | None:
        """``self(key)`` from an event loop."""
        caller = await self.acaller(key)
        return None if caller is None else caller.tenant_id

    async def acaller(self, key: str) -> Caller | None:
        """[`caller`][] from an event loop: a key verified within ``ttl_s`` is answered on
        the loop, a look-up by ``atenant_of_key`` (by default ``tenant_of_key`` in a thread).
        An async caller must not pay a thread hop (and, in a fresh process, the import of the
        thread pool's machinery: 10 ms on a worker's first request) for what a dict holds."""
        fingerprint, cached = self._cached(key)
        if cached is not None:
            return cached
        forgets = self._forgets
        return self._remember(fingerprint, _as_caller(await self._atenant_of_key(key)), forgets)

    def forget_user(self, tenant_id: str, user_id: str) -> None:
        """Stop trusting the cached keys of one user of a tenant (an erasure deleted them):
        on this worker they fail at once, not up to ``ttl_s`` later, and a look-up under way
        meanwhile is not kept."""
        with self._lock:
            self._forgets += 1
            self._verified = {
                fingerprint: entry
                for fingerprint, entry in self._verified.items()
                if (entry[0].tenant_id, entry[0].user_id) != (tenant_id, user_id)
            }

    def _cached(self, key: str) -> tuple[str, Caller | None]:
        fingerprint = hashlib.sha256(key.encode()).hexdigest()
        cached = self._verified.get(fingerprint)
        if cached is not None and cached[1] > time.monotonic():
            return fingerprint, cached[0]
        return fingerprint, None

    def _remember(self, fingerprint: str, found: Caller | None, forgets: int) -> Caller | None:
        if found is not None:
            with self._lock:
                if forgets == self._forgets:
                    self._verified[fingerprint] = (found, time.monotonic() + self._ttl_s)
        return found


def _rows(statement: Statement) -> Plan[list[tuple[Any, ...]]]:
    return [tuple(row) for row in (yield statement).rows]


def _erase_user(tenant_id: str, user_id: str) -> Plan[dict[str, int]]:
    keys = "SELECT key_id FROM keel_api_keys WHERE tenant_id = ? AND user_id = ?"
    sessions = yield Statement(
        f"DELETE FROM keel_ui_sessions WHERE key_id IN ({keys})", (tenant_id, user_id)
    )
    deleted = yield Statement(
        "DELETE FROM keel_api_keys WHERE tenant_id = ? AND user_id = ?", (tenant_id, user_id)
    )
    return {"api_keys": int(deleted.rowcount), "ui_sessions": int(sessions.rowcount)}
