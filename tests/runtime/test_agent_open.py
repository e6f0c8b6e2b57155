"""``Agent.open``: one composition root on SQLite, PostgreSQL, and PostgreSQL + Redis.

Each test runs a few turns with a side-effecting tool through the built agent, then looks
where the rows landed by querying the databases directly, and checks that ``close`` released
every connection and thread it opened (warnings are errors: a leaked pool fails the test).
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from keel.errors import ConfigError, UsageError
from keel.runtime import Agent
from keel.settings import load_settings
from keel.testing import ScriptedModel
from keel.tools import Tool, tool

EMAIL = "ada@example.com"


def _booking_tool(booked: list[str]) -> Tool:
    @tool(side_effect=True, idempotent=False)
    def book(city: str) -> str:
        """Book a trip.

        Args:
            city: Where to.
        """
        booked.append(city)
        return f"booked {city}, reference R{len(booked)}"

    return book


def _model(cities: list[str]) -> ScriptedModel:
    replies: list[Any] = []
    for city in cities:
        replies += [ScriptedModel.tool_call("book", json.dumps({"city": city})), f"Booked {city}."]
    return ScriptedModel(replies)


CITIES = ["Oslo", "Lima", "Pune"]


async def _converse(agent: Agent) -> None:
    for city in CITIES:
        reply = await agent.handle("s1", "u1", f"Book {city}; mail me at {EMAIL}.")
        assert reply.status == "completed" and reply.text == f"Booked {city}."


def _threads() -> set[int]:
    return {t.ident for t in threading.enumerate() if t.ident is not None}


def _settle_threads(before: set[int]) -> set[str]:
    """Names of threads started since ``before`` that are still alive after a short wait. Not
    the agent's but the process's, shared by every agent: the test event loop's executor
    threads (``asyncio_N``), the idle sync-tool threads (``keel-thread``, ending after 30 s idle),
    the one sync bridge loop (``keel-sync-bridge``) and the bridge's pool for blocking work
    (``keel-blocking_N``), both alive for the process's lifetime."""
    deadline = time.monotonic() + 5
    while True:
        extra = {
            t.name
            for t in threading.enumerate()
            if t.ident not in before
            and t.is_alive()
            and not t.name.startswith(
                ("asyncio_", "keel-thread", "keel-sync-bridge", "keel-blocking")
            )
        }
        if not extra or time.monotonic() > deadline:
            return extra
        time.sleep(0.05)


@pytest.fixture(autouse=True)
def _hashing_embedder(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEEL_EMBEDDER", "hashing:64")


# --- SQLite -----------------------------------------------------------------------------------


def _sqlite_rows(path: Path) -> dict[str, int]:
    with sqlite3.connect(path) as conn:
        return {
            table: int(conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0])
            for table in (
                "keel_state_checkpoints",
                "keel_tool_journal",
                "trace_runs",
                "memory_records",
            )
        }


async def test_open_on_sqlite_is_what_embedded_builds(tmp_path: Path) -> None:
    before = _threads()
    figures = {}
    for how in ("open", "embedded"):
        path = tmp_path / f"{how}.db"
        booked: list[str] = []
        url = f"sqlite:///{path}"
        if how == "open":
            agent = Agent.open(
                url, model=_model(CITIES), system_prompt="You book.", tools=[_booking_tool(booked)]
            )
        else:
            agent = Agent.embedded(
                _model(CITIES),
                system_prompt="You book.",
                tools=[_booking_tool(booked)],
                settings=load_settings(database=url),
            )
        try:
            assert agent.backends is not None and agent.backends.database.path == path
            await _converse(agent)
            assert agent.memory is not None
            await agent.memory.aflush()
        finally:
            await agent.aclose()
        assert booked == CITIES
        figures[how] = _sqlite_rows(path)
        # Everything on the one file, the e-mail masked in memory.
        with sqlite3.connect(path) as conn:
            texts = [row[0] for row in conn.execute("SELECT text FROM memory_records")]
        assert texts and not any(EMAIL in text for text in texts)
    assert figures["open"] == figures["embedded"]
    assert all(count > 0 for count in figures["open"].values())
    assert _settle_threads(before) == set()


def test_open_reads_keel_database_and_closes_sync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "env.db"
    monkeypatch.setenv("KEEL_DATABASE", f"sqlite:///{path}")
    booked: list[str] = []
    agent = Agent.open(
        model=_model(["Oslo"]), system_prompt="You book.", tools=[_booking_tool(booked)]
    )
    try:
        assert agent.handle_sync("s1", "u1", "Book Oslo.").text == "Booked Oslo."
    finally:
        agent.close()
        agent.close()  # idempotent
    assert booked == ["Oslo"] and _sqlite_rows(path)["keel_tool_journal"] == 1


# --- PostgreSQL (and Redis) -------------------------------------------------------------------


def _pg_count(url: str, sql: str) -> int:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(sql).fetchone()
    assert row is not None
    return int(row[0])


def _other_connections(url: str) -> int:
    """Client sessions on this database other than the one asking (not autovacuum)."""
    return _pg_count(
        url,
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
        "AND backend_type = 'client backend' AND pid <> pg_backend_pid()",
    )


def _connections_drain(url: str) -> bool:
    """True once no other session is on this database (a closed client's server process
    leaves pg_stat_activity a moment after the socket closes)."""
    # One probe that sees none decides: a second probe right after it could count the first
    # probe's own server process, still on its way out.
    deadline = time.monotonic() + 5
    while _other_connections(url):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.postgres
async def test_open_on_postgres_puts_every_store_there(postgres_url: str) -> None:
    before = _threads()
    booked: list[str] = []
    agent = Agent.open(
        postgres_url,
        model=_model(CITIES),
        system_prompt="You book.",
        tools=[_booking_tool(booked)],
    )
    try:
        assert agent.backends is not None
        assert agent.backends.database.kind == "postgres" and agent.backends.redis is None
        await _converse(agent)
        assert agent.memory is not None
        await agent.memory.aflush()
        assert _other_connections(postgres_url) > 0
    finally:
        await agent.aclose()
    assert booked == CITIES
    key = agent.session_key("s1")
    assert (
        _pg_count(
            postgres_url, f"SELECT count(*) FROM keel_state_sessions WHERE session_id = '{key}'"
        )
        == 1
    )
    assert _pg_count(postgres_url, "SELECT count(*) FROM keel_state_checkpoints") > 0
    assert (
        _pg_count(
            postgres_url,
            "SELECT count(*) FROM keel_tool_journal WHERE tool = 'book' AND status = 'succeeded'",
        )
        == 3
    )
    assert _pg_count(postgres_url, "SELECT count(*) FROM trace_runs") == 3
    assert _pg_count(postgres_url, "SELECT count(*) FROM memory_records") > 0
    # One privacy policy: the e-mail reached neither memory nor the traces.
    for table, column in (("memory_records", "text"), ("trace_runs", "input")):
        assert (
            _pg_count(postgres_url, f"SELECT count(*) FROM {table} WHERE {column} LIKE '%{EMAIL}%'")
            == 0
        )
    assert _connections_drain(postgres_url)
    assert _settle_threads(before) == set()


@pytest.mark.postgres
async def test_open_on_postgres_holds_one_pool_for_every_store(postgres_url: str) -> None:
    pool_size = 2
    agent = Agent.open(
        load_settings(database=postgres_url, postgres_pool_size=pool_size),
        model=_model(CITIES),
        system_prompt="You book.",
        tools=[_booking_tool([])],
    )
    try:
        backends = agent.backends
        assert backends is not None and agent.memory is not None
        await _converse(agent)
        await agent.memory.aflush()
        stores = (backends.state.backend, backends.journal, backends.traces, agent.memory.store)
        assert len({id(getattr(store, "db", store)) for store in stores}) == 1
        # The shared pool, and as many again for the state's native async calls on this
        # loop. A pool per store held five at least (state's two, one each for the rest).
        assert 0 < _other_connections(postgres_url) <= 2 * pool_size
    finally:
        await agent.aclose()
    assert _connections_drain(postgres_url)


def _sync_turns(postgres_url: str) -> Agent:
    booked: list[str] = []
    agent = Agent.open(
        postgres_url,
        model=_model(["Oslo", "Lima"]),
        system_prompt="You book.",
        tools=[_booking_tool(booked)],
        memory=False,
    )
    try:
        assert agent.handle_sync("s1", "u1", "Book Oslo.").text == "Booked Oslo."
        assert agent.handle_sync("s1", "u1", "Book Lima.").text == "Booked Lima."
    finally:
        agent.close()
    assert booked == ["Oslo", "Lima"]
    return agent


@pytest.mark.postgres
def test_open_on_postgres_sync_twins_and_close(postgres_url: str) -> None:
    before = _threads()
    _sync_turns(postgres_url)
    assert _pg_count(postgres_url, "SELECT count(*) FROM keel_tool_journal") == 2
    assert _settle_threads(before) == set()


@pytest.mark.postgres
def test_sync_close_on_postgres_leaves_no_connection(postgres_url: str) -> None:
    _sync_turns(postgres_url)
    assert _connections_drain(postgres_url)


@pytest.mark.postgres
def test_an_agent_awaited_on_event_loops_that_ended_closes_on_postgres(postgres_url: str) -> None:
    # A script's asyncio.run(agent.revert(...)) (revert has no sync twin) or asyncio.run per
    # turn: each loop got its own async pool, and close() then raised "Event loop is closed"
    # on the dead loop's pool, leaving the sync pool open.
    import asyncio

    model = ScriptedModel(["Hi."], repeat_last=True)
    agent = Agent.open(postgres_url, model=model, system_prompt="You greet.", memory=False)
    asyncio.run(agent.run("Hello", session="s1", user="u1"))
    asyncio.run(agent.run("Hello again", session="s1", user="u1"))
    head = agent.state.history(agent.session_key("s1"))[0].version
    reverted = asyncio.run(agent.revert("s1", expected_version=head, to_version=1))
    assert reverted.version == head + 1
    failure: Exception | None = None
    try:
        agent.close()
    except Exception as exc:  # the defect: an untyped RuntimeError from a dead loop's pool
        failure = exc
    assert failure is None, repr(failure)
    assert _connections_drain(postgres_url)


@pytest.mark.postgres
@pytest.mark.redis
async def test_open_on_postgres_and_redis_keeps_state_on_redis(
    postgres_url: str, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import redis

    monkeypatch.setenv("KEEL_DATABASE", postgres_url)
    monkeypatch.setenv("KEEL_REDIS_URL", redis_url)
    client = redis.Redis.from_url(redis_url)
    clients_before = len(client.client_list())
    before = _threads()
    booked: list[str] = []
    agent = Agent.open(
        load_settings(),
        model=_model(CITIES),
        system_prompt="You book.",
        tools=[_booking_tool(booked)],
    )
    try:
        assert agent.backends is not None and agent.backends.redis is not None
        await _converse(agent)
        assert agent.session_state("s1") is not None
    finally:
        await agent.aclose()
    assert booked == CITIES
    keys = [key.decode() for key in client.keys("keel:state:*")]
    assert any(agent.session_key("s1") in key for key in keys), keys
    # State is on Redis: PostgreSQL never got the state tables; the rest is there.
    assert (
        _pg_count(postgres_url, "SELECT count(*) FROM pg_tables WHERE tablename LIKE 'keel_state%'")
        == 0
    )
    assert (
        _pg_count(postgres_url, "SELECT count(*) FROM keel_tool_journal WHERE tool = 'book'") == 3
    )
    assert _pg_count(postgres_url, "SELECT count(*) FROM trace_runs") == 3
    assert _pg_count(postgres_url, "SELECT count(*) FROM memory_records") > 0
    assert _connections_drain(postgres_url)
    assert len(client.client_list()) == clients_before
    client.close()
    assert _settle_threads(before) == set()


# --- bad URLs ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    ["mysql://db/keel", "keel.db", "sqlite://relative.db", "sqlite:///", "redis://localhost/0", ""],
)
def test_a_bad_database_url_is_a_config_error(url: str) -> None:
    with pytest.raises(ConfigError):
        Agent.open(url, model=ScriptedModel(["hi"]), system_prompt="hi", memory=False)


def test_a_bad_redis_url_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="Redis"):
        Agent.open(
            f"sqlite:///{tmp_path / 'k.db'}",
            model=ScriptedModel(["hi"]),
            system_prompt="hi",
            redis_url="postgresql://h/db",
        )
    # Nothing was left open: the file can be opened again at once (and is not locked).
    agent = Agent.open(
        f"sqlite:///{tmp_path / 'k.db'}", model=ScriptedModel(["hi"]), system_prompt="hi"
    )
    agent.close()


def test_settings_twice_and_a_wrong_type_are_config_errors(tmp_path: Path) -> None:
    settings = load_settings(database=f"sqlite:///{tmp_path / 'k.db'}")
    with pytest.raises(ConfigError, match="twice"):
        Agent.open(settings, settings=settings, model=ScriptedModel(["hi"]), system_prompt="hi")
    with pytest.raises(ConfigError, match="Path"):
        Agent.open(tmp_path / "k.db", model=ScriptedModel(["hi"]), system_prompt="hi")  # type: ignore[arg-type]


def test_embedded_still_refuses_a_server_database() -> None:
    settings = load_settings(database="postgresql://nowhere/db")
    with pytest.raises(UsageError, match=r"Agent\.open"):
        Agent.embedded(ScriptedModel(["hi"]), system_prompt="hi", settings=settings)


@pytest.mark.postgres
def test_an_unreachable_redis_closes_what_was_opened_before_it(postgres_url: str) -> None:
    from keel.errors import BackendUnavailableError
    from keel.testing.servers import free_port

    before = _threads()
    with pytest.raises(BackendUnavailableError):
        Agent.open(
            postgres_url,
            redis_url=f"redis://127.0.0.1:{free_port()}/0",
            model=ScriptedModel(["hi"]),
            system_prompt="hi",
        )
    # The journal and traces were opened on PostgreSQL before Redis failed: closed again.
    assert _pg_count(postgres_url, "SELECT count(*) FROM trace_runs") == 0
    assert _connections_drain(postgres_url)
    assert _settle_threads(before) == set()


# --- keel chat --database ---------------------------------------------------------------------


@pytest.mark.postgres
def test_keel_chat_on_postgres(postgres_url: str) -> None:
    import os
    import subprocess
    import sys

    src = str(Path(__file__).resolve().parents[2] / "src")
    chat = subprocess.run(
        [sys.executable, "-m", "keel", "chat", "--database", postgres_url, "-m", "scripted:echo"],
        input="My dog is called Rex\n/trace\n",
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])},
    )
    assert chat.returncode == 0, chat.stderr
    assert "agent> My dog is called Rex" in chat.stdout
    assert "scripted:echo" in chat.stdout.split("agent>")[-1]  # /trace read the run back
    assert _pg_count(postgres_url, "SELECT count(*) FROM trace_runs WHERE agent = 'chat'") == 1
    assert _pg_count(postgres_url, "SELECT count(*) FROM keel_state_sessions") == 1
    # One turn: the user's words and the model's, each its own record.
    assert _pg_count(postgres_url, "SELECT count(*) FROM memory_records") == 2
    assert _connections_drain(postgres_url)


async def test_async_with_releases_what_open_opened(tmp_path: Path) -> None:
    before = _threads()
    booked: list[str] = []
    async with Agent.open(
        f"sqlite:///{tmp_path / 'with.db'}",
        model=_model(["Oslo"]),
        system_prompt="You book.",
        tools=[_booking_tool(booked)],
    ) as agent:
        reply = await agent.run("Book Oslo.", session="s1", user="u1")
        assert reply.text == "Booked Oslo."
    assert booked == ["Oslo"]
    assert _settle_threads(before) == set(), "the memory worker outlived the with block"


def test_with_releases_what_open_opened(tmp_path: Path) -> None:
    path = tmp_path / "with.db"
    booked: list[str] = []
    with Agent.open(
        f"sqlite:///{path}",
        model=_model(["Oslo"]),
        system_prompt="You book.",
        tools=[_booking_tool(booked)],
    ) as agent:
        assert agent.run_sync("Book Oslo.", session="s1", user="u1").text == "Booked Oslo."
        backends = agent.backends
        assert backends is not None
    assert booked == ["Oslo"] and _sqlite_rows(path)["keel_tool_journal"] == 1
    assert not backends._closers, "the with block did not close what open opened"


# --- what the factories build -----------------------------------------------------------------


def test_open_refuses_the_stores_it_builds_itself(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'k.db'}"
    for given in ("state", "tracer"):
        with pytest.raises(UsageError, match=rf"\['{given}'\].*construct Agent"):
            Agent.open(url, model=ScriptedModel(["hi"]), system_prompt="hi", **{given: object()})  # type: ignore[arg-type]


def test_a_subclass_is_built_as_itself(tmp_path: Path) -> None:
    class BookingAgent(Agent):
        pass

    settings = load_settings(database=f"sqlite:///{tmp_path / 'k.db'}")
    with BookingAgent.open(settings, model=ScriptedModel(["hi"]), system_prompt="hi") as opened:
        assert type(opened) is BookingAgent
        assert opened.backends is not None
        shared = BookingAgent.on_backends(
            opened.backends, ScriptedModel(["hi"]), system_prompt="hi"
        )
        assert type(shared) is BookingAgent and shared.backends is None
    with BookingAgent.embedded(ScriptedModel(["hi"]), system_prompt="hi", settings=settings) as one:
        assert type(one) is BookingAgent


def test_embedded_keeps_state_in_its_file_whatever_keel_redis_url_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from keel.testing.servers import free_port

    # Nothing listens there: opening it would fail.
    monkeypatch.setenv("KEEL_REDIS_URL", f"redis://127.0.0.1:{free_port()}/0")
    settings = load_settings(database=f"sqlite:///{tmp_path / 'k.db'}")
    assert settings.redis_url
    with Agent.embedded(ScriptedModel(["Hi."]), system_prompt="hi", settings=settings) as agent:
        assert agent.backends is not None and agent.backends.redis is None
        assert agent.run_sync("Hello.", session="s1", user="u1").text == "Hi."
    assert _sqlite_rows(tmp_path / "k.db")["keel_state_checkpoints"] > 0


def test_an_agent_that_cannot_be_built_closes_the_stores_opened_for_it(tmp_path: Path) -> None:
    before = _threads()
    with pytest.raises(UsageError, match="system prompt"):
        Agent.open(f"sqlite:///{tmp_path / 'k.db'}", model=ScriptedModel(["hi"]), system_prompt=" ")
    assert _settle_threads(before) == set(), "memory's outbox worker outlived the failed open"
