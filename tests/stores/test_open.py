"""The one opener: ``Backends.open`` from settings or a URL, all the stores or ``only=`` some."""

from __future__ import annotations

import threading
from functools import partial
from pathlib import Path

import pytest

from keel.errors import ConfigError, KeelError, StoreError, UsageError
from keel.memory import HashingEmbedder, Scope
from keel.privacy import MaskingPolicy, PIIMasker
from keel.runtime import Agent
from keel.settings import load_settings
from keel.state import AgentState
from keel.stores import (
    STORE_NAMES,
    Backends,
    MemoryOptions,
    PostgresDatabase,
    RedisStateBackend,
    SQLiteDatabase,
)
from keel.stores._sql_memory import rows_of
from keel.stores._sql_plan import Statement
from keel.testing import ScriptedModel
from tests.cli import keel_process


@pytest.fixture(autouse=True)
def _hashing_embedder(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEEL_EMBEDDER", "hashing:64")


def test_a_url_without_settings_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="settings="):
        Backends.open(f"sqlite:///{tmp_path / 'k.db'}")


def test_the_settings_redis_moves_state_unless_the_caller_says_not(
    tmp_path: Path, redis_url: str
) -> None:
    settings = load_settings(data_dir=tmp_path, redis_url=redis_url)
    with Backends.open(settings, memory=False) as backends:
        assert backends.redis is not None
        assert isinstance(backends.state.backend, RedisStateBackend)
    with Backends.open(settings, memory=False, redis_url="") as backends:
        assert backends.redis is None
        assert not isinstance(backends.state.backend, RedisStateBackend)


def test_leaving_the_with_block_closes_the_database(tmp_path: Path) -> None:
    with Backends.open(load_settings(data_dir=tmp_path), memory=False) as backends:
        sql = backends.sql
        assert isinstance(sql, SQLiteDatabase)
        sql.connection()
    with pytest.raises(StoreError, match="closed"):
        sql.connection()


def _outbox_workers() -> set[threading.Thread]:
    return {thread for thread in threading.enumerate() if thread.name == "keel-memory-outbox"}


def test_memory_without_its_worker_embeds_only_when_flushed(tmp_path: Path) -> None:
    scope = Scope(tenant_id="t", user_id="u")
    before = _outbox_workers()
    with Backends.open(load_settings(data_dir=tmp_path), background=False) as backends:
        memory = backends.memory
        assert memory is not None
        assert _outbox_workers() == before, "an outbox worker was started"
        memory.add("the dog is called Rex", scope=scope)
        assert memory.embedding_status().missing == 1
        memory.flush()
        assert memory.embedding_status().missing == 0


def test_a_state_backend_opened_alone_closes_its_database(tmp_path: Path) -> None:
    opened = Backends.open(
        f"sqlite:///{tmp_path / 'state.db'}", settings=load_settings(), only=("state",)
    )
    backend = opened.state.backend
    database = backend.db  # type: ignore[attr-defined]
    assert isinstance(database, SQLiteDatabase)
    database.connection()
    backend.close()
    with pytest.raises(StoreError, match="closed"):
        database.connection()
    opened.close()  # closing the backends too is harmless


def _tables(path: Path) -> set[str]:
    import sqlite3

    with sqlite3.connect(path) as connection:
        rows = connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
        return {name for (name,) in rows}


def test_only_opens_the_stores_it_names_and_says_which_are_missing(tmp_path: Path) -> None:
    settings = load_settings(data_dir=tmp_path)
    with Backends.open(settings, only=("journal",)) as backends:
        assert backends.opened == {"journal"}
        backends.journal.get("nothing")
        assert backends.memory is None and backends.vault is None
        with pytest.raises(
            UsageError, match="state store was not opened: these backends hold journal"
        ):
            _ = backends.state
        with pytest.raises(UsageError, match="traces"):
            _ = backends.traces
    tables = _tables(tmp_path / "keel.db")
    assert any("journal" in name for name in tables), tables
    assert not any("trace" in name or "memor" in name for name in tables), tables


@pytest.mark.parametrize(
    ("only", "memory", "said"),
    [
        (["memroy", None], True, "no store named 'memroy', None in only="),
        ([["state"]], True, "no store named ['state'] in only="),
        (5, True, "only= takes store names"),
        (["state", "memory"], False, "only= names memory but memory=False"),
    ],
)
def test_only_that_names_no_store_is_a_usage_error(
    tmp_path: Path, only: object, memory: bool, said: str
) -> None:
    # Each was a bare TypeError (sorting a name beside None, a list, an int), or memory
    # asked for by name and left out without a word.
    settings = load_settings(data_dir=tmp_path, embedder="hashing:8")
    error: Exception | None = None
    try:
        Backends.open(settings, only=only, memory=memory)  # type: ignore[arg-type]
    except Exception as exc:
        error = exc
    assert isinstance(error, UsageError) and said in str(error), repr(error)


def test_only_the_database_alone_is_left_unmigrated(tmp_path: Path) -> None:
    with Backends.open(load_settings(data_dir=tmp_path), only=()) as backends:
        assert backends.opened == frozenset()
        assert isinstance(backends.sql, SQLiteDatabase)
    assert not any("journal" in name or "state" in name for name in _tables(tmp_path / "keel.db"))


def test_an_unknown_store_name_is_refused_with_the_names_there_are(tmp_path: Path) -> None:
    settings = load_settings(data_dir=tmp_path)
    with pytest.raises(UsageError, match="'checkpoints'.*the stores are " + ", ".join(STORE_NAMES)):
        Backends.open(settings, only=("state", "checkpoints"))  # type: ignore[list-item]
    with pytest.raises(UsageError, match=r"only=\('state',\)"):
        Backends.open(settings, only="state")  # type: ignore[arg-type]
    assert not (tmp_path / "keel.db").exists(), "a refused call opened the database"


def test_a_redis_url_opens_the_state_alone(tmp_path: Path, redis_url: str) -> None:
    settings = load_settings(data_dir=tmp_path)
    with pytest.raises(ConfigError, match="Redis URL holds the state alone"):
        Backends.open(redis_url, settings=settings)
    with Backends.open(redis_url, settings=settings, only=("state",)) as backends:
        assert isinstance(backends.state.backend, RedisStateBackend)
        with pytest.raises(UsageError, match="no SQL database"):
            _ = backends.sql
    assert not (tmp_path / "keel.db").exists()


def test_agents_on_the_stores_mask_with_their_privacy_policy(tmp_path: Path) -> None:
    """One policy, set once on the stores, for the agents' messages, traces and memory: here
    it masks e-mail addresses only (the default would mask the phone number too)."""
    emails_only = PIIMasker(MaskingPolicy(entities=frozenset({"EMAIL"})))
    settings = load_settings(data_dir=tmp_path)
    message = "Mail bob@example.com or call +1 415 555 0100"
    with Backends.open(settings, privacy=emails_only) as backends:
        agent = Agent.on_backends(backends, ScriptedModel(["Noted."]), system_prompt="Hi.")
        agent.run_sync(message, session="s1", user="u1")
        [run] = backends.traces.list_runs()
        assert run.input is not None
        assert "bob@example.com" not in run.input and "+1 415 555 0100" in run.input
        assert agent.memory is not None and agent.memory.masker is emails_only


def test_memory_options_give_memory_its_own_embedder(tmp_path: Path) -> None:
    embedder = HashingEmbedder(16)
    options = MemoryOptions(embedder=embedder)
    with Backends.open(
        load_settings(data_dir=tmp_path), only=("memory",), vault=False, memory=options
    ) as backends:
        assert backends.memory is not None and backends.memory.embedder is embedder
        assert backends.vault is None
    with Backends.open(load_settings(data_dir=tmp_path), only=("memory",), vault=False) as other:
        assert other.memory is not None and other.memory.embedder.name == "keel-hashing-64"


def test_the_vault_store_counts_a_vault_opened_without_its_key(tmp_path: Path) -> None:
    settings = load_settings(data_dir=tmp_path)
    with Backends.open(settings, memory=False) as sealed:
        assert sealed.vault is not None
        sealed.vault.user("t", "u").placeholder("EMAIL", "bob@example.com")
        assert sealed.vault_store is sealed.vault.store
    with Backends.open(settings, memory=False, vault=False) as keyless:
        assert keyless.vault is None
        counts = keyless.vault_store.counts()
        assert (counts.users, counts.values) == (1, 1)
        assert keyless.vault_store is keyless.vault_store  # built once


def test_the_memory_store_is_built_only_where_memory_has_tables(tmp_path: Path) -> None:
    settings = load_settings(data_dir=tmp_path)
    with Backends.open(settings, memory=False) as without:
        assert without.memory_store is None
    assert not any("memor" in name for name in _tables(tmp_path / "keel.db"))
    with Backends.open(settings) as with_memory:
        assert with_memory.memory is not None
        assert with_memory.memory_store is with_memory.memory.store
    with Backends.open(settings, memory=False) as after:
        store = after.memory_store
        assert store is not None and store.count() == 0


def test_the_state_prefix_is_the_redis_key_prefix(tmp_path: Path, redis_url: str) -> None:
    import redis

    settings = load_settings(data_dir=tmp_path)
    with Backends.open(redis_url, settings=settings, only=("state",), state_prefix="app") as opened:
        opened.state.create("t/s1", AgentState())
    keys = {key.decode() for key in redis.Redis.from_url(redis_url).scan_iter()}
    assert keys and all(key.startswith("app:") for key in keys), keys
    with pytest.raises(UsageError, match="state_prefix"):
        Backends.open(settings, memory=False, state_prefix="app")


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://ada:s3cret@[::1/keel",  # an IPv6 host never closed
        "postgresql://ada:s3cret@localhost:99999/keel",
        "postgresql://ada:s3cret@localhost:port/keel",
        "postgresql://ada:s3cret@one:5432,two:0/keel",
    ],
)
def test_a_postgresql_url_libpq_cannot_read_is_a_config_error_without_its_password(
    tmp_path: Path, url: str
) -> None:
    # Not "the server is down" (BackendUnavailableError, retried by callers): the URL is
    # wrong, and libpq's own reason quotes the whole URI, password included.
    raised: Exception | None = None
    try:
        Backends.open(url, settings=load_settings(data_dir=tmp_path), memory=False).close()
    except Exception as exc:  # the type is the assertion, not the raise
        raised = exc
    assert isinstance(raised, ConfigError), repr(raised)
    assert "s3cret" not in str(raised)
    result = keel_process("memory", "status", "--database", url)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr and "s3cret" not in result.stderr + result.stdout


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://ada:pa%ss-s3cret@localhost/keel",  # a generated password's own "%"
        "postgresql://ada:s3cret%00@localhost/keel",
        "postgresql://ada@localhost/keel?password=s3cr%zzet",
    ],
)
def test_a_password_libpq_cannot_decode_is_not_quoted_in_the_error(
    tmp_path: Path, url: str
) -> None:
    # libpq quotes the token it could not percent-decode: the password, when it is the one.
    raised: Exception | None = None
    try:
        Backends.open(url, settings=load_settings(data_dir=tmp_path), memory=False).close()
    except Exception as exc:  # the message is the assertion, not the raise
        raised = exc
    assert isinstance(raised, ConfigError), repr(raised)
    assert "s3cr" not in str(raised), str(raised)


def test_a_key_value_connection_string_is_named_without_its_password() -> None:
    # libpq's other spelling, which psycopg (and so PostgresDatabase) takes as well: the
    # messages and the repr named "where" by the whole string, password and all.
    conninfo = "host=127.0.0.1 port=1 user=ada password=s3cret dbname=keel connect_timeout=1"
    raised: list[str] = []
    for spelled in (conninfo, conninfo.replace("port=1", "port=99999")):
        try:
            with PostgresDatabase(spelled, timeout=2) as database:
                raised.append(repr(database))
                database.run(partial(rows_of, Statement("SELECT 1")))
        except KeelError as exc:
            raised.append(str(exc))
    assert len(raised) == 3 and "127.0.0.1" in raised[0], raised
    assert not [said for said in raised if "s3cret" in said], raised
