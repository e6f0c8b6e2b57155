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

``memory=`` takes [`MemoryOptions`][] where memory is built otherwise than the settings say (a
memory bench's embedder, PostgreSQL's vector index), and ``state_prefix=`` the Redis key prefix
state is kept under (the state bench's own). [`Backends.vault_store`][] and
[`Backends.memory_store`][] are the vault's and memory's stores for work that needs neither
the master key nor an embedder (counting the vault's rows, a user's erasure, retention): built
here on first use when the vault or memory did not open.

``only=`` names the stores wanted, for whoever needs fewer than an agent: the state alone
(``KeelCheckpointSaver(url)``, ``keel state``, the state conformance kit: a Redis URL is
accepted there), the state and the vault (the adapters' histories), the journal alone, or none
(the database alone, unmigrated: ``keel doctor``). A state store opened alone (or with the
vault alone) owns its database, so that its backend can be handed on
(``StateStore(backends.state.backend, MyState)``) and closing it closes the database. The
store classes themselves take a database object, never a URL; URLs are parsed by
[`keel._urls.parse_database_url`][], as everywhere.

It opens everything or nothing: a store that fails to open closes the ones opened before it.
[`Backends.close`][] / [`Backends.aclose`][] release them in reverse order, memory first so
that its outbox worker stops before its database goes away.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypeVar, get_args

from pydantic import SecretStr

from keel._bridge import run_blocking
from keel._urls import DatabaseURL, parse_database_url
from keel.approvals import ApprovalStore
from keel.errors import ConfigError, UsageError, VaultKeyError
from keel.privacy import (
    DEFAULT_MASKER,
    KeyProvider,
    KeyRing,
    MasterKey,
    PIIMasker,
    Vault,
)
from keel.privacy._keys import embedded_key
from keel.settings import Settings, default_pii_key_file
from keel.state import AgentState, StateStore
from keel.stores._postgres import PostgresDatabase
from keel.stores._redis_client import RedisDurability
from keel.stores._redis_state import RedisStateBackend
from keel.stores._sql_approvals import SQLApprovalStore
from keel.stores._sql_journal import SQLToolJournal
from keel.stores._sql_plan import table_names
from keel.stores._sql_state import SQLStateBackend
from keel.stores._sql_traces import SQLTraceStore
from keel.stores._sql_vault import SQLVaultStore
from keel.stores._sqlite import SQLiteDatabase
from keel.stores._sqlite_vault import SQLiteVaultStore
from keel.tools import ToolJournal
from keel.tracing import TraceStore

if TYPE_CHECKING:
    from keel.memory import Embedder, Memory, MemoryStore

__all__ = ["STORE_NAMES", "Backends", "MemoryOptions", "StoreName", "pii_key_from_settings"]

logger = logging.getLogger("keel.stores")

_AsyncClose = Callable[[], Awaitable[None]] | None
_Closer = tuple[Callable[[], None], _AsyncClose]
"""How to release one thing: sync, and natively async where the client is bound to a loop."""
_Own = Callable[[Callable[[], None], _AsyncClose], None]


StoreName = Literal["state", "journal", "approvals", "traces", "memory", "vault"]
"""A store [`Backends.open`][] can open (``only=``)."""

STORE_NAMES: tuple[StoreName, ...] = get_args(StoreName)
"""Every store [`Backends.open`][] opens unless ``only=`` names fewer."""

_DEFAULT_STATE_PREFIX = "keel:state"
"""The Redis key prefix state is kept under unless ``state_prefix=`` says otherwise."""

_READINESS_PROBE = "keel-readiness-probe"
"""A state key no session has (theirs are ``tenant/session``): reading it checks that the
state store answers."""


@dataclass(frozen=True)
class MemoryOptions:
    """Memory as [`Backends.open`][] builds it where the settings do not say it all: for
    whoever measures one memory on a database of its own (``keel bench memory``, ``keel bench
    locomo``). ``Backends.open(..., memory=MemoryOptions(...))`` opens memory with them."""

    embedder: Embedder | None = None
    """The embedder (None: the settings' ``embedder``)."""
    hnsw: bool = True
    """PostgreSQL: an HNSW index on each vector table as it is created (False: exact scans,
    the index built later, e.g. once after a bulk load)."""
    halfvec: bool = False
    """PostgreSQL: index and search the vectors as 16-bit ``halfvec``."""


@dataclass
class Backends:
    """What an agent stores into, opened from one database URL (and optionally Redis).

    Open it with [`open`][]; close it with [`close`][] or [`aclose`][] (an
    [`Agent`][] built by [`open`][keel.runtime.Agent.open] does this in its own
    ``close``), or use it as a context manager. A store left out by ``only=`` is not there:
    reading it is a ``UsageError`` that says so.
    """

    database: DatabaseURL
    """The database URL opened: the SQL database (journal, traces and memory, and state
    without Redis), or the Redis of a state store opened alone from a Redis URL."""
    redis: DatabaseURL | None
    """The Redis that holds state, if any."""
    settings: Settings
    """The settings the stores were opened with (read once, at the edge, and handed down)."""
    opened: frozenset[StoreName]
    """The stores opened (``only=``; memory and the vault only when they are on)."""
    memory: Memory | None
    """Long-term memory (its outbox indexed in the background), or None when off."""
    privacy: PIIMasker | None
    """The privacy policy memory masks with, and the one agents on these stores mask messages
    and traces with unless given their own (None: masking off)."""
    vault: Vault | None
    """The PII vault on the SQL database (masked values kept sealed per tenant and user), or
    None when no master key was given (masking as before: values are dropped)."""
    _state: StateStore[AgentState] | None = field(default=None, repr=False)
    _journal: ToolJournal | None = field(default=None, repr=False)
    _approvals: ApprovalStore | None = field(default=None, repr=False)
    _traces: TraceStore | None = field(default=None, repr=False)
    _sql: SQLiteDatabase | PostgresDatabase | None = field(default=None, repr=False)
    _closers: list[_Closer] = field(default_factory=list, repr=False)
    _vault_store: SQLVaultStore | None = field(default=None, repr=False)
    _memory_store: MemoryStore | None = field(default=None, repr=False)

    @property
    def state(self) -> StateStore[AgentState]:
        """Session checkpoints and leases."""
        return _opened(self._state, "state", self.opened)

    @property
    def journal(self) -> ToolJournal:
        """The exactly-once journal of side-effecting tool calls."""
        return _opened(self._journal, "journal", self.opened)

    @property
    def approvals(self) -> ApprovalStore:
        """The queue of tool calls and escalated turns waiting for a person's decision."""
        return _opened(self._approvals, "approvals", self.opened)

    @property
    def traces(self) -> TraceStore:
        """Run traces."""
        return _opened(self._traces, "traces", self.opened)

    @property
    def sql(self) -> SQLiteDatabase | PostgresDatabase:
        """The SQL database the journal, traces and memory live in (more tables may join them:
        ``keel serve``'s API keys)."""
        if self._sql is None:
            raise UsageError(f"no SQL database was opened: the state alone is on {self.database}")
        return self._sql

    @property
    def vault_store(self) -> SQLVaultStore:
        """The PII vault's store on the SQL database: the open vault's, else one built here
        (on first use, its schema applied) without the master key, for what needs none:
        counting its rows (``keel privacy status``), deleting a user's (an erasure)."""
        if self.vault is not None and isinstance(self.vault.store, SQLVaultStore):
            return self.vault.store
        if self._vault_store is None:
            self._vault_store = _vault_store(self.sql)
        return self._vault_store

    @property
    def memory_store(self) -> MemoryStore | None:
        """Memory's store: the open memory's, else one built here on the SQL database when it
        holds memory's tables (None otherwise: nothing is created), for work that needs no
        embedder: a user's erasure, retention (a service running with memory off may hold
        records from before)."""
        if self.memory is not None:
            return self.memory.store
        if self._memory_store is None and "memory_records" in table_names(self.sql):
            store = self._memory_store = _memory_store(self.sql, MemoryOptions())
            self._closers.append((store.close, None))
        return self._memory_store

    @classmethod
    def open(
        cls,
        database: str | Settings | None,
        *,
        only: Iterable[StoreName] | None = None,
        settings: Settings | None = None,
        redis_url: str | None = None,
        memory: bool | MemoryOptions = True,
        background: bool = True,
        privacy: PIIMasker | None = DEFAULT_MASKER,
        pii_key: KeyProvider | KeyRing | None = None,
        vault: bool | None = None,
        state_prefix: str | None = None,
    ) -> Backends:
        """Open the stores on ``database`` (state on Redis if set): all, or those ``only`` names.

        Args:
            database: ``sqlite:///PATH`` or ``postgresql://...`` (``redis://...`` for the
                state alone), the settings whose ``database_url`` to open, or None: the
                ``database_url`` of ``settings``.
            only: the stores wanted, of [`STORE_NAMES`][keel.stores.STORE_NAMES] (default:
                all). Memory brings the vault it seals values in; ``()`` opens the SQL
                database alone, unmigrated. The state alone (or with the vault alone) owns
                its database, so that its backend can be handed on.
            settings: the SQLite busy timeout, the PostgreSQL pool size, the embedder, the
                Redis URL (required with a URL: keel reads settings once, at its edge).
            redis_url: ``redis://...``: state on Redis, the rest on ``database`` (default:
                ``settings.redis_url``; ``""``: state on ``database`` whatever it says).
            memory: open long-term memory (embedder from ``settings.embedder``); or
                [`MemoryOptions`][]: its own embedder, PostgreSQL's index.
            background: memory embeds in its background worker (False: on ``flush`` only).
            privacy: the privacy policy (memory masks with it; agents on these stores too,
                unless given their own). None turns masking off.
            pii_key: the PII vault's master key (a [`MasterKey`][], a KMS-backed
                [`KeyProvider`][], or a [`KeyRing`][] mid-rotation); default: the settings'
                ``pii_key``, else ``pii_key_file`` (``pii_key_previous*`` the previous key);
                none: on SQLite keel's own key file (`default_pii_key_file`, made on first
                use), on PostgreSQL no vault (a warning says so once).
            vault: False: no vault, masking only (no key made or required); default:
                ``settings.pii_vault``.
            state_prefix: the Redis key prefix of state (default ``keel:state``).

        Raises:
            UsageError: a URL (or None) without ``settings``, ``only`` naming no store (or
                memory with ``memory=False``), or ``state_prefix`` for state not on Redis.
            ConfigError: settings given twice, ``database`` of another type, or a URL keel
                cannot open (a Redis URL for more than the state, an unknown scheme).
            BackendUnavailableError: a server cannot be reached or its driver is not installed.
            StoreError: a database cannot be opened or migrated.
            VaultKeyError: the PII key is malformed, its file is missing or open to others,
                it is not the key this database's vault was sealed with, or no key is given
                for a PostgreSQL database that holds a vault (nothing is left open).
        """
        wanted = _wanted(only, memory=memory is not False)
        settings, url = _settings_and_url(database, settings)
        parsed, redis = _urls(url, wanted, settings.redis_url if redis_url is None else redis_url)
        _check_state_prefix(state_prefix, redis, wanted)
        vault_on, keys = _vault_keys(settings, wanted, vault, pii_key)
        opened = _Opened(memory_options=memory if isinstance(memory, MemoryOptions) else None)
        try:
            opened.open(parsed, redis, wanted, settings, keys, vault_on, state_prefix)
            opened.open_memory(settings, background=background, privacy=privacy)
        except BaseException:
            opened.close_quietly()
            raise
        return cls(
            database=parsed,
            redis=redis,
            settings=settings,
            opened=opened.names(wanted),
            memory=opened.memory,
            privacy=privacy,
            vault=opened.vault,
            _state=opened.state,
            _journal=opened.journal,
            _approvals=opened.approvals,
            _traces=opened.traces,
            _sql=opened.sql,
            _closers=opened.closers,
        )

    async def aready(self, connections: int = 1) -> None:
        """Wait until every store answers: the SQL database with ``connections`` pooled
        connections open (PostgreSQL), and the state store (one read).

        Raises:
            BackendUnavailableError: a server does not answer.
            StoreError: a database cannot be read.
        """
        if self._sql is not None:
            await self._sql.aping(connections)
        if self.redis is not None and self._state is not None:
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
                    await run_blocking(sync)
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]

    def __enter__(self) -> Backends:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


T = TypeVar("T")


@dataclass
class _Opened:
    """What one [`Backends.open`][] has opened so far, and how to close it (newest first)."""

    sql: SQLiteDatabase | PostgresDatabase | None = None
    state: StateStore[AgentState] | None = None
    journal: ToolJournal | None = None
    approvals: ApprovalStore | None = None
    traces: TraceStore | None = None
    memory_store: MemoryStore | None = None
    memory: Memory | None = None
    vault: Vault | None = None
    closers: list[_Closer] = field(default_factory=list)
    memory_options: MemoryOptions | None = None

    def own(self, sync: Callable[[], None], asynchronous: _AsyncClose) -> None:
        self.closers.append((sync, asynchronous))

    def open(
        self,
        parsed: DatabaseURL,
        redis: DatabaseURL | None,
        wanted: frozenset[StoreName],
        settings: Settings,
        keys: KeyProvider | KeyRing | None,
        vault_on: bool,
        state_prefix: str | None = None,
    ) -> None:
        """The SQL database and the stores ``wanted`` on it, then the state on ``redis``."""
        on_sql = wanted - {"state"} if redis is not None else wanted
        if parsed.kind != "redis" and (on_sql or not wanted):
            self.sql = _open_sql(parsed, settings, self.own)
            if "state" in on_sql and on_sql <= {"state", "vault"}:
                # The state with nothing but its vault: the state's backend owns the database.
                self.state = _state_alone(self.sql, self.closers)
                on_sql -= {"state"}
            _open_on_sql(self, on_sql, keys, vault_on, self.own)
        if redis is not None and "state" in wanted:
            prefix = _DEFAULT_STATE_PREFIX if state_prefix is None else state_prefix
            self.state = _state_on_redis(redis, settings, self.own, prefix)

    def open_memory(
        self, settings: Settings, *, background: bool, privacy: PIIMasker | None
    ) -> None:
        """Memory on the memory store opened (if any), sealing values in the vault."""
        if self.memory_store is None:
            return
        # Lazy: memory's modules load numpy, which an agent with memory off never needs.
        from keel.memory import Memory, embedder_from_settings

        embedder = None if self.memory_options is None else self.memory_options.embedder
        self.memory = Memory(
            self.memory_store,
            embedder=embedder_from_settings(settings) if embedder is None else embedder,
            background=background,
            masker=privacy,
            vault=self.vault,
        )
        # Memory.close stops the outbox worker and closes the store; it runs first (closers
        # pop from the end), before the database it writes to is closed.
        self.own(self.memory.close, None)

    def close_quietly(self) -> None:
        """Close what was opened, newest first, when opening the rest failed."""
        while self.closers:
            with contextlib.suppress(Exception):
                self.closers.pop()[0]()

    def names(self, wanted: frozenset[StoreName]) -> frozenset[StoreName]:
        present = {
            "state": self.state,
            "journal": self.journal,
            "approvals": self.approvals,
            "traces": self.traces,
            "memory": self.memory,
            "vault": self.vault,
        }
        return frozenset(name for name in wanted if present[name] is not None)


def _check_state_prefix(
    prefix: str | None, redis: DatabaseURL | None, wanted: frozenset[StoreName]
) -> None:
    """Raises:
    UsageError: a Redis key prefix for state that is not on Redis."""
    if prefix is not None and (redis is None or "state" not in wanted):
        raise UsageError("state_prefix= is the Redis key prefix: state is not on Redis here")


def _urls(
    url: str, wanted: frozenset[StoreName], redis_url: str | None
) -> tuple[DatabaseURL, DatabaseURL | None]:
    """The database ``url`` names, and the Redis that holds state (if any).

    Raises:
        ConfigError: a URL keel cannot open, or a Redis URL for more than the state.
    """
    try:
        parsed = parse_database_url(url)
    except ConfigError as exc:
        if wanted == {"state"}:
            raise ConfigError(f"unknown state backend URL: {exc}") from None
        raise
    if parsed.kind != "redis":
        return parsed, _redis(redis_url)
    if wanted != {"state"}:
        raise ConfigError(
            f"a Redis URL holds the state alone (only=('state',)), not "
            f"{', '.join(sorted(wanted - {'state'})) or 'the SQL database'}: give the "
            "SQL database's URL, and the Redis one as redis_url"
        )
    return parsed, parsed


def _vault_keys(
    settings: Settings,
    wanted: frozenset[StoreName],
    vault: bool | None,
    pii_key: KeyProvider | KeyRing | None,
) -> tuple[bool, KeyProvider | KeyRing | None]:
    """Whether the vault is on, and its keys: ``pii_key`` when given, else the settings'."""
    vault_on = "vault" in wanted and (settings.pii_vault if vault is None else vault)
    if not vault_on:
        return False, None
    return True, pii_key if pii_key is not None else pii_key_from_settings(settings)


def _wanted(only: Iterable[StoreName] | None, *, memory: bool) -> frozenset[StoreName]:
    """The stores to open: ``only`` checked against [`STORE_NAMES`][keel.stores.STORE_NAMES],
    memory dropped when it is off, and the vault brought in by memory (it seals values there).

    Raises:
        UsageError: a name that is no store's, names given otherwise than as an iterable of
            strings (one string, a number), or memory named while ``memory=False``.
    """
    if only is None:
        names: list[object] = list(STORE_NAMES)
    elif isinstance(only, str) or not isinstance(only, Iterable):
        raise UsageError(f"only= takes store names, e.g. only=('state',), not {only!r}")
    else:
        names = list(only)
    unknown = sorted({repr(name) for name in names if name not in STORE_NAMES})
    if unknown:
        raise UsageError(
            f"no store named {', '.join(unknown)} in only=: the stores are {', '.join(STORE_NAMES)}"
        )
    wanted = frozenset(name for name in STORE_NAMES if name in names)
    if not memory and only is not None and "memory" in wanted:
        raise UsageError("only= names memory but memory=False: leave one of them out")
    if not memory:
        wanted -= {"memory"}
    if "memory" in wanted:
        wanted |= {"vault"}
    return wanted


def _settings_and_url(
    database: str | Settings | None, settings: Settings | None
) -> tuple[Settings, str]:
    """The settings to open with, and the URL to open.

    Raises:
        ConfigError: settings given twice, or ``database`` of another type.
        UsageError: a URL (or None) without settings.
    """
    if isinstance(database, Settings):
        if settings is not None:
            raise ConfigError("settings given twice: positionally and as settings=")
        return database, database.database_url
    if database is not None and not isinstance(database, str):
        raise ConfigError(f"a database URL or Settings is needed, not {type(database).__name__}")
    if settings is None:
        raise UsageError(
            "Backends.open(url) needs settings= (busy timeout, pool size, embedder): "
            "load them once with keel.settings.load_settings() and pass them"
        )
    return settings, settings.database_url if database is None else database


def _opened(store: T | None, name: StoreName, opened: frozenset[StoreName]) -> T:
    if store is None:
        raise UsageError(
            f"the {name} store was not opened: these backends hold "
            f"{', '.join(sorted(opened)) or 'no store'} (Backends.open's only=)"
        )
    return store


def _open_on_sql(
    opened: _Opened,
    names: frozenset[StoreName],
    keys: KeyProvider | KeyRing | None,
    vault_on: bool,
    own: _Own,
) -> None:
    """The stores ``names`` on ``opened.sql`` (migrated); they close with it, but for the
    vault's, which holds nothing of its own either."""
    sql = opened.sql
    assert sql is not None
    if "journal" in names:
        opened.journal = SQLToolJournal(sql)
    if "approvals" in names:
        opened.approvals = SQLApprovalStore(sql)
    if "traces" in names:
        opened.traces = _trace_store(sql)
    if "memory" in names:
        opened.memory_store = _memory_store(sql, opened.memory_options or MemoryOptions())
    if "vault" in names:
        opened.vault = _open_vault(sql, keys, wanted=vault_on)
        if opened.vault is not None:
            own(opened.vault.store.close, None)
    if "state" in names:
        opened.state = StateStore(SQLStateBackend(sql), AgentState)


def _memory_store(sql: SQLiteDatabase | PostgresDatabase, options: MemoryOptions) -> MemoryStore:
    """Memory's store on ``sql`` (migrated): PostgreSQL's vector index as ``options`` say."""
    # Lazy: the memory stores load numpy, which an agent with memory off never needs.
    if isinstance(sql, SQLiteDatabase):
        from keel.stores._sqlite_memory import SQLiteMemoryStore

        return SQLiteMemoryStore(sql)
    # Lazy as above: numpy (and pgvector's adapters) only for memory.
    from keel.stores._postgres_memory import PostgresMemoryStore

    return PostgresMemoryStore(sql, hnsw=options.hnsw, halfvec=options.halfvec)


def _vault_store(sql: SQLiteDatabase | PostgresDatabase) -> SQLVaultStore:
    """The vault's store on ``sql`` (migrated; it holds nothing of its own)."""
    return SQLiteVaultStore(sql) if isinstance(sql, SQLiteDatabase) else SQLVaultStore(sql)


def _trace_store(sql: SQLiteDatabase | PostgresDatabase) -> TraceStore:
    if isinstance(sql, SQLiteDatabase):
        return SQLTraceStore(sql)
    # Imports psycopg at module level: the postgres extra, present since the pool opened.
    from keel.stores._postgres_traces import PostgresTraceStore

    return PostgresTraceStore(sql)


def _state_alone(
    sql: SQLiteDatabase | PostgresDatabase, closers: list[_Closer]
) -> StateStore[AgentState]:
    """The state store on ``sql``, its backend owning ``sql``: closing it (or a store it is
    handed on to) closes the database (and the vault's store on it, which holds nothing of
    its own)."""
    backend = _SQLStateAlone(sql)
    # The backend closes the database from here: its closer takes the database's place.
    closers.pop()
    asynchronous = backend.aclose if isinstance(sql, PostgresDatabase) else None
    closers.append((backend.close, asynchronous))
    return StateStore(backend, AgentState)


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


def _state_on_redis(
    redis: DatabaseURL, settings: Settings, own: _Own, prefix: str
) -> StateStore[AgentState]:
    durability = RedisDurability(
        wait_replicas=settings.redis_wait_replicas,
        wait_timeout_ms=settings.redis_wait_timeout_ms,
        policy=settings.redis_durability,
    )
    backend = RedisStateBackend(redis.url, durability=durability, prefix=prefix)
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


def _open_vault(
    sql: SQLiteDatabase | PostgresDatabase,
    keys: KeyProvider | KeyRing | None,
    *,
    wanted: bool = True,
) -> Vault | None:
    """The PII vault on ``sql`` (migrated, its master key checked): under ``keys`` when
    given; else, unless ``wanted`` is False (masking only, no key made or required), on SQLite
    under the key file keel keeps in the config directory (`default_pii_key_file`, made on
    first use) and on PostgreSQL none.
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
    vault = Vault(_vault_store(sql), keys)
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
    store = _vault_store(sql)
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


class _SQLStateAlone(SQLStateBackend):
    """A SQL state backend opened alone from a URL: it owns its database."""

    def close(self) -> None:
        self.db.close()

    async def aclose(self) -> None:
        if isinstance(self.db, PostgresDatabase):
            await self.db.aclose()
        else:
            self.db.close()
