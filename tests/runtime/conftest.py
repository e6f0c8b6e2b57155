"""Shared parts of the runtime tests: one SQLite file per test, an Agent on its stores."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from keel.models import ChatModel
from keel.runtime import Agent
from keel.state import AgentState, StateStore
from keel.stores import SQLiteDatabase, SQLStateBackend, SQLToolJournal
from keel.tools import Tool


@pytest.fixture
def database(tmp_path: Path) -> Iterator[SQLiteDatabase]:
    """The test's SQLite file (state, journal, traces), closed afterwards."""
    db = SQLiteDatabase(tmp_path / "keel.db")
    yield db
    db.close()


def sqlite_agent(
    database: SQLiteDatabase,
    model: ChatModel,
    tools: Sequence[Tool] = (),
    **options: Any,
) -> Agent:
    """An Agent on ``database``'s state store and durable journal ("You help.")."""
    return Agent(
        model,
        state=StateStore(SQLStateBackend(database), AgentState),
        system_prompt="You help.",
        tools=tools,
        journal=SQLToolJournal(database),
        **options,
    )
