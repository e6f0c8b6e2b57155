"""Memory's store applies its schema when it is built, as every store does; a memory that is
off is never built, so an agent without memory leaves no memory tables behind."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from keel.runtime import Agent
from keel.settings import load_settings
from keel.stores import SQLiteDatabase, SQLiteMemoryStore
from keel.testing import ScriptedModel


def _tables(path: Path) -> set[str]:
    with sqlite3.connect(path) as connection:
        rows = connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
        return {name for (name,) in rows}


def test_a_memory_store_creates_its_tables_when_built(tmp_path: Path) -> None:
    with SQLiteDatabase(tmp_path / "memory.db") as database:
        SQLiteMemoryStore(database)  # built, not used
        assert {"memory_records", "memory_outbox"} <= _tables(tmp_path / "memory.db")


@pytest.mark.parametrize("memory", [False, True])
def test_an_agent_builds_memory_only_when_it_is_on(tmp_path: Path, memory: bool) -> None:
    settings = load_settings(data_dir=tmp_path, embedder="hashing:64")
    with Agent.open(
        settings, model=ScriptedModel(["Noted."]), system_prompt="Hi.", memory=memory
    ) as agent:
        assert (agent.memory is not None) is memory
        assert agent.run_sync("Remember me.", session="s1", user="u1").status == "completed"
        assert (agent.backends is not None) and (agent.backends.memory is not None) is memory
    tables = _tables(tmp_path / "keel.db")
    assert ("memory_records" in tables) is memory, tables
