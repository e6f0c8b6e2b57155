"""The composition root: every store keel opens from a database URL is opened here.

[`Backends.open`][] opens state, the tool journal, the approvals queue, traces and memory
on one database: ``sqlite:///PATH`` is one SQLite file (one
[`SQLiteDatabase`][]) holding all five; ``postgresql://...`` is the five
PostgreSQL stores sharing one [`PostgresDatabase`][] (one connection pool).
Either way a Redis URL moves state (checkpoints and session leases) to Redis, while the
journal, the approvals, traces and memory stay on the SQL
database: they are queried (``keel runs``, ``keel tools in-doubt``, retrieval), which Redis is
not built for. Given a PII master key (``pii_key=``, else the settings' ``pii_key`` /
``pii_key_file``), the PII vault opens on the SQL database too, and its key is checked there:
a wrong key is a ``VaultKeyError`` at start-up, never values stored raw.

It opens everything or nothing: a store that fails to open closes the ones opened before it.
[`Backends.close`][] / [`Backends.aclose`][] release them in reverse order, memory first so
that its outbox worker stops before its database goes away.

Two narrower openers remain, for their public signatures: [`open_state_backend`][] (a state
backend alone, from any URL: ``KeelCheckpointSaver(url)``, the Agents SDK session, the state
conformance kit) and [`open_database`][] (the embedded SQLite file, unmigrated: ``keel
doctor``). Both parse the URL with [`keel._urls.parse_database_url`][], as ``Backends.open``
does; the store classes themselves take a database object, never a URL. Whoever opens a
database opens its PII vault with [`open_vault`][], so that the adapters get the same vault
(and the same embedded default key) as an agent on ``Backends.open``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import SecretStr

from keel._urls import DatabaseURL, parse_database_url
from keel.approvals import ApprovalStore
from keel.errors import ConfigError, UsageError, VaultKeyError
from keel.memory import Memory, MemoryStore, embedder_from_settings
from keel.privacy import (
    DEFAULT_MASKER,
    KeyProvider,
    KeyRing,
    MasterKey,
    PIIMasker,
    Vault,
    VaultStore,
)
from keel.privacy._keys import embedded_key
from keel.settings import Settings, default_pii_key_file
from keel.state import AgentState, StateBackend, StateStore
from keel.stores._postgres import PostgresDatabase
from keel.stores._postgres_approvals import PostgresApprovalStore
from keel.stores._postgres_journal import PostgresToolJournal
from keel.stores._postgres_memory import PostgresMemoryStore
from keel.stores._postgres_vault import PostgresVaultStore
from keel.stores._redis_state import RedisStateBackend
from keel.stores._sql_state import SQLStateBackend
from keel.stores._sqlite import SQLiteDatabase
from keel.stores._sqlite_approvals import SQLiteApprovalStore
from keel.stores._sqlite_journal import SQLiteToolJournal
from keel.stores._sqlite_memory import SQLiteMemoryStore
from keel.stores._sqlite_traces import SQLiteTraceStore
from keel.stores._sqlite_vault import SQLiteVaultStore
from keel.tools import ToolJournal
from keel.tracing import TraceStore

__all__ = [
    "Backends",
    "open_database",
    "open_state_backend",
    "open_vault",
    "pii_key_from_settings",
]

logger = logging.getLogger("keel.stores")

_AsyncClose = Callable[[], Awaitable[None]] | None
_Closer = tuple[Callable[[], None], _AsyncClose]
"""How to release one thing: sync, and natively async where the client is bound to a loop."""
_Own = Callable[[Callable[[], None], _AsyncClose], None]


_READINESS_PROBE = "keel-readiness-probe"
"""A state key no session has (theirs are ``tenant/session``): reading it checks that the
state store answers."""


@dataclass
class Backends:
    """What an agent stores into, opened from one database URL (and optionally Redis).

    Open it with [`open`][]; close it with [`close`][] or [`aclose`][] (an
    [`Agent`][] built by [`open`][keel.runtime.Agent.open] does this in its own
    ``close``), or use it as a context manager.
    """

    database: DatabaseURL
    """The SQL database: journal, traces and memory (and state without Redis)."""
    redis: DatabaseURL | None
    """The Redis that holds state, if any."""
    state: StateStore[AgentState]
    """Session checkpoints and leases."""
    journal: ToolJournal
    """The exactly-once journal of side-effecting tool calls."""
    approvals: ApprovalStore
    """The queue of tool calls and escalated turns waiting for a person's decision."""
    traces: TraceStore
    """Run traces."""
    memory: Memory | None
    """Long-term memory (its outbox indexed in the background), or None when off."""
    sql: SQLiteDatabase | PostgresDatabase
    """The SQL database the journal, traces and memory live in (more tables may join them:
    ``keel serve``'s API keys)."""
    privacy: PIIMasker | None = DEFAULT_MASKER
    """The privacy policy memory masks with, and the one agents on these stores mask messages
    and traces with unless given their own (None: masking off)."""
    vault: Vault | None = None
    """The PII vault on the SQL database (masked values kept sealed per tenant and user), or
    None when no master key was given (masking as before: values are dropped)."""
    _closers: list[_Closer] = field(default_factory=list, repr=False)

    @classmethod
    def open(
        cls,
        database: str | Settings,
        *,
        settings: Settings | None = None,
        redis_url: str | None = None,
        memory: bool = True,
        background: bool = True,
        privacy: PIIMasker | None = DEFAULT_MASKER,
        pii_key: KeyProvider | KeyRing | None = None,
        vault: bool | None = None,
    ) -> Backends:
        """Open state, journal, traces and memory on ``database`` (state on Redis if set).

        Args:
            database: ``sqlite:///PATH`` or ``postgresql://...``, or the settings whose
                ``database_url`` to open.
            settings: the SQLite busy timeout, the PostgreSQL pool size, the embedder and the
                Redis URL (required with a URL: keel reads its settings once, at its edge,
                and hands them down).
            redis_url: ``redis://...``: state on Redis, the rest on ``database`` (default:
                ``settings.redis_url``; ``""``: state on ``database`` whatever it says).
            memory: open long-term memory (embedder from ``settings.embedder``).
            background: memory embeds in its background worker (False: on ``flush`` /
                ``process_outbox`` only, as a one-shot command wants).
            privacy: the privacy policy (memory masks with it; agents on these stores too,
                unless given their own). None turns masking off.
            pii_key: the PII vault's master key (a [`MasterKey`][] or a
                KMS-backed [`KeyProvider`][]), or a
                [`KeyRing`][] while a rotation is under way; default:
                ``settings.pii_key``, else ``settings.pii_key_file`` (with
                ``settings.pii_key_previous`` / ``pii_key_previous_file`` as the previous key);
                none of them: on SQLite the key file keel keeps in the config directory
                (`default_pii_key_file`, made on first use), on
                PostgreSQL no vault (a warning says so once).
            vault: False: no vault, masking only (no key made or required); default:
                ``settings.pii_vault``.

        Raises:
            UsageError: a URL without ``settings``.
            ConfigError: a URL keel cannot open (a Redis URL as the database, an unknown scheme).
            BackendUnavailableError: a server cannot be reached or its driver is not installed.
            StoreError: a database cannot be opened or migrated.
            VaultKeyError: the PII key is malformed, its file is missing or open to others,
                it is not the key this database's vault was sealed with, or no key is given
                for a PostgreSQL database that holds a vault (nothing is left open).
        """
        if isinstance(database, Settings):
            settings, database = database, database.database_url
        elif settings is None:
            raise UsageError(
                "Backends.open(url) needs settings= (busy timeout, pool size, embedder): "
                "load them once with keel.settings.load_settings() and pass them"
            )
        parsed = parse_database_url(database, kinds=("sqlite", "postgres"))
        redis = _redis(settings.redis_url if redis_url is None else redis_url)
        wanted = settings.pii_vault if vault is None else vault
        keys = None
        if wanted:
            keys = pii_key if pii_key is not None else pii_key_from_settings(settings)
        closers: list[_Closer] = []

        def own(
            sync: Callable[[], None], asynchronous: Callable[[], Awaitable[None]] | None
        ) -> None:
            closers.append((sync, asynchronous))

        try:
            sql = _open_sql(parsed, settings, own)
            journal, approvals, traces, store = _sql_stores(sql)
            opened = open_vault(sql, keys, wanted=wanted)
            if opened is not None:
                own(opened.store.close, None)
            state = (
                _state_on_redis(redis, own)
                if redis is not None
                else StateStore(SQLStateBackend(sql), AgentState)
            )
            long_term = None
            if memory:
                long_term = Memory(
                    store,
                    embedder=embedder_from_settings(settings),
                    background=background,
                    masker=privacy,
                    vault=opened,
                )
                # Memory.close stops the outbox worker and closes the store; it runs first
                # (closers pop from the end), before the database it writes to is closed.
                own(long_term.close, None)
        except BaseException:
            while closers:
                with contextlib.suppress(Exception):
                    closers.pop()[0]()
            raise
        return cls(
            parsed,
            redis,
            state,
            journal,
            approvals,
            traces,
            long_term,
            sql,
            privacy,
            opened,
            closers,
        )

    async def aready(self, connections: int = 1) -> None:
        """Wait until every store answers: the SQL database with ``connections`` pooled
        connections open (PostgreSQL), and the state store (one read).

        Raises:
            BackendUnavailableError: a server does not answer.
            StoreError: a database cannot be read.
        """
        await self.sql.aping(connections)
        if self.redis is not None:
            # The journal, traces and memory are on the SQL database; state is not.
            await self.state.apeek(_READINESS_PROBE)

    def close(self) -> None:
        """Stop memory's outbox worker and release every connection, newest first (idempotent)."""
        errors: list[BaseException] = []
        while self._closers:
            sync, _ = self._closers.pop()
            try:
                sync()
            except Exception as exc:  # close the rest, then report the first failure
                errors.append(exc)
        if errors:
            raise errors[0]

    async def aclose(self) -> None:
        """Async twin of [`close`][]: async clients are closed on the running event loop."""
        errors: list[BaseException] = []
        while self._closers:
            sync, asynchronous = self._closers.pop()
            try:
                if asynchronous is not None:
                    await asynchronous()
                else:
                    await asyncio.to_thread(sync)
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]

    def __enter__(self) -> Backends:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _redis(url: str | None) -> DatabaseURL | None:
    if not url:
        return None
    try:
        return parse_database_url(url, kinds=("redis",))
    except ConfigError as exc:
        raise ConfigError(f"the Redis URL: {exc}") from None


def _open_sql(
    parsed: DatabaseURL, settings: Settings, own: _Own
) -> SQLiteDatabase | PostgresDatabase:
    """The SQL database ``parsed`` names, tuned by ``settings``, closed last (closers pop from
    the end): after memory's outbox worker stopped writing to it."""
    if parsed.path is not None:
        sqlite = SQLiteDatabase(parsed.path, busy_timeout_ms=settings.busy_timeout_ms)
        own(sqlite.close, None)
        return sqlite
    # One pool for the four stores.
    postgres = PostgresDatabase(parsed.url, max_size=settings.postgres_pool_size)
    own(postgres.close, postgres.aclose)
    return postgres


def _state_on_redis(redis: DatabaseURL, own: _Own) -> StateStore[AgentState]:
    backend = RedisStateBackend(redis.url)
    own(backend.close, backend.aclose)
    return StateStore(backend, AgentState)


def pii_key_from_settings(settings: Settings) -> KeyRing | None:
    """The PII master keys the settings give: ``pii_key`` (``KEEL_PII_KEY``), else
    ``pii_key_file`` (``KEEL_PII_KEY_FILE``), with ``pii_key_previous`` /
    ``pii_key_previous_file`` beside it while a rotation is under way; None when no current
    key is set (the vault is off).

    Raises:
        VaultKeyError: one is set but holds no usable key (never ignored), or a previous key
            is given without a current one.
    """
    current = _settings_key(settings.pii_key, settings.pii_key_file, "KEEL_PII_KEY")
    previous = _settings_key(
        settings.pii_key_previous, settings.pii_key_previous_file, "KEEL_PII_KEY_PREVIOUS"
    )
    if current is None:
        if previous is not None:
            raise VaultKeyError(
                "KEEL_PII_KEY_PREVIOUS is set without KEEL_PII_KEY: the previous key only "
                "unwraps beside a current one"
            )
        return None
    return KeyRing(current, [] if previous is None else [previous])


def _settings_key(text: SecretStr | None, path: Path | None, variable: str) -> MasterKey | None:
    if text is not None:
        return MasterKey.from_text(text.get_secret_value(), source=variable)
    if path is not None:
        return MasterKey.from_file(path)
    return None


def open_vault(
    sql: SQLiteDatabase | PostgresDatabase,
    keys: KeyProvider | KeyRing | None,
    *,
    wanted: bool = True,
) -> Vault | None:
    """The PII vault on ``sql`` (migrated, its master key checked), as every opener of keel
    opens it: under ``keys`` when given; else, unless ``wanted`` is False (masking only, no
    key made or required), on SQLite under the key file keel keeps in the config directory
    (`default_pii_key_file`, made on first use) and on PostgreSQL none.
    Its store holds nothing of its own: it closes with ``sql``.

    Raises:
        VaultKeyError: the key is not this database's vault's, the key file cannot be made or
            read, or no key is given for a PostgreSQL database that holds a vault.
    """
    if keys is not None:
        return _checked_vault(sql, keys)
    if not wanted:
        return None
    if isinstance(sql, SQLiteDatabase):
        return _open_embedded_vault(sql)
    _no_vault_without_its_key(sql)
    return None


def _checked_vault(sql: SQLiteDatabase | PostgresDatabase, keys: KeyProvider | KeyRing) -> Vault:
    store: VaultStore = (
        SQLiteVaultStore(sql) if isinstance(sql, SQLiteDatabase) else PostgresVaultStore(sql)
    )
    vault = Vault(store, keys)
    vault.check()
    return vault


def _open_embedded_vault(sql: SQLiteDatabase) -> Vault:
    """The embedded database's vault, under the key file keel keeps for it."""
    path = default_pii_key_file()
    try:
        return _checked_vault(sql, embedded_key(path))
    except VaultKeyError as exc:
        raise VaultKeyError(
            f"{exc} [with keel's own key file {path}, used as no KEEL_PII_KEY or "
            "KEEL_PII_KEY_FILE is set: set the key this database was sealed with, or "
            "KEEL_PII_VAULT=off for masking only]"
        ) from exc


_warned_no_vault = False


def _no_vault_without_its_key(sql: PostgresDatabase) -> None:
    """A server database opened with no key: refused if it holds a vault (its users' turns
    would fail, or store values unsealed beside sealed ones), else said once in the log.

    Raises:
        VaultKeyError: the database holds a vault.
    """
    global _warned_no_vault
    store = PostgresVaultStore(sql)
    counts = store.counts()
    if store.key_checks() or counts.users or counts.values:
        raise VaultKeyError(
            f"this database holds a PII vault ({counts.users} users, {counts.values} values "
            "sealed) but no PII master key is given: set KEEL_PII_KEY or KEEL_PII_KEY_FILE "
            "(KEEL_PII_VAULT=off to run without it, its users' placeholders unresolved)"
        )
    if not _warned_no_vault:
        _warned_no_vault = True
        logger.warning(
            "no PII master key for the PostgreSQL database %s: the vault is off, masked "
            "values are dropped and tools get placeholders; set KEEL_PII_KEY (`keel privacy "
            "new-key`), or KEEL_PII_VAULT=off to say masking alone is meant",
            sql.url.split("@")[-1],
        )


def _sql_stores(
    sql: SQLiteDatabase | PostgresDatabase,
) -> tuple[ToolJournal, ApprovalStore, TraceStore, MemoryStore]:
    """The journal, the approvals queue, the traces (migrated) and the memory store on
    ``sql``; they close with it."""
    if isinstance(sql, SQLiteDatabase):
        journal: ToolJournal = SQLiteToolJournal(sql)
        approvals: ApprovalStore = SQLiteApprovalStore(sql)
        traces: TraceStore = SQLiteTraceStore(sql)
        store: MemoryStore = SQLiteMemoryStore(sql)
    else:
        # Imports psycopg at module level: the postgres extra, present since the pool opened.
        from keel.stores._postgres_traces import PostgresTraceStore

        journal = PostgresToolJournal(sql)
        approvals = PostgresApprovalStore(sql)
        traces = PostgresTraceStore(sql)
        store = PostgresMemoryStore(sql)
    traces.setup()
    return journal, approvals, traces, store


class _SQLStateAlone(SQLStateBackend):
    """A SQL state backend opened alone from a URL: it owns its database."""

    def close(self) -> None:
        self.database.close()

    async def aclose(self) -> None:
        if isinstance(self.database, PostgresDatabase):
            await self.database.aclose()
        else:
            self.database.close()


def open_state_backend(url: str) -> StateBackend:
    """The state backend a URL names, alone; closing it closes the connections it opened.

    ``sqlite:///path/to/keel.db`` (a file: several connections share it), ``postgresql://...`` /
    ``postgres://...``, ``redis://...`` / ``rediss://...``.

    Raises:
        ConfigError: an unknown scheme.
        BackendUnavailableError: the server cannot be reached or its driver is not installed.
    """
    try:
        parsed = parse_database_url(url)
    except ConfigError as exc:
        raise ConfigError(f"unknown state backend URL: {exc}") from None
    if parsed.kind == "redis":
        return RedisStateBackend(parsed.url)
    database: SQLiteDatabase | PostgresDatabase = (
        SQLiteDatabase(parsed.path) if parsed.path is not None else PostgresDatabase(parsed.url)
    )
    try:
        return _SQLStateAlone(database)
    except BaseException:
        database.close()
        raise


def open_database(settings: Settings) -> SQLiteDatabase:
    """The embedded database the settings name (no migrations applied yet).

    Raises:
        UsageError: the settings name a server database; open it with [`Backends.open`][].
    """
    path = settings.sqlite_path
    if path is None:
        raise UsageError(
            f"{settings.parsed_database.kind} databases are opened by Backends.open, "
            "not as the embedded SQLite database"
        )
    return SQLiteDatabase(path, busy_timeout_ms=settings.busy_timeout_ms)
