"""A caller's turn id (an HTTP ``Idempotency-Key``) through the real Agent on SQLite, once the
session no longer holds that turn: its recorded reply was dropped (only the newest 16 are
kept) or the session was reverted to before it. A retry of the same message gets the same
reply and runs nothing; the id sent with another message is refused and replays nothing of
the turn it named."""

from __future__ import annotations

import pytest

from keel.errors import UsageError
from keel.runtime import Agent
from keel.stores import SQLiteDatabase
from keel.testing import ScriptedModel
from tests.runtime.conftest import sqlite_agent
from tests.runtime.test_agent_api import _booker, _books


def _agent(database: SQLiteDatabase, booked: list[str]) -> Agent:
    return sqlite_agent(database, ScriptedModel(_books), [_booker(booked)])


async def test_a_retry_after_its_reply_left_the_session_gets_that_reply_and_runs_nothing(
    database: SQLiteDatabase,
) -> None:
    booked: list[str] = []
    agent = _agent(database, booked)
    first = await agent.run("Book Oslo", session="s1", user="u1", turn_id="req-1")
    for n in range(16):  # the session keeps the replies of the newest 16 such turns
        await agent.run(f"Book C{n}", session="s1", user="u1", turn_id=f"req-{n + 2}")
    state = agent.session_state("s1")
    assert state is not None
    assert all(r["turn_id"] != "req-1" for r in state.runtime.replies)
    # The retry comes late, to another process: a fresh agent, no cache.
    again = _agent(database, booked)
    retried = await again.run("Book Oslo", session="s1", user="u1", turn_id="req-1")
    assert retried.replayed and (retried.text, retried.run_id) == (first.text, first.run_id)
    assert booked.count("Oslo") == 1, "the retry booked again"
    with pytest.raises(UsageError, match="another message"):
        await again.run("Book Lima", session="s1", user="u1", turn_id="req-1")
    assert "Lima" not in booked
    after = again.session_state("s1")
    assert after is not None and len(after.messages) == len(state.messages), "a turn ran"


async def test_an_id_reused_after_a_revert_replays_nothing_of_its_first_turn(
    database: SQLiteDatabase,
) -> None:
    booked: list[str] = []
    agent = _agent(database, booked)
    before = await agent.run("Book Rome", session="s1", user="u1", turn_id="req-0")
    first = await agent.run("Book Oslo", session="s1", user="u1", turn_id="req-1")
    # The operator puts the session back to before that turn; its booking stays made.
    await agent.revert("s1", expected_version=first.state_version, to_version=before.state_version)
    with pytest.raises(UsageError, match="another message"):
        await agent.run("Book Lima", session="s1", user="u1", turn_id="req-1")
    assert booked == ["Rome", "Oslo"], "nothing may run under an id another message used"
    # The same message again is a retry: the same reply, nothing run again.
    retried = await agent.run("Book Oslo", session="s1", user="u1", turn_id="req-1")
    assert retried.replayed and (retried.text, retried.run_id) == (first.text, first.run_id)
    assert booked == ["Rome", "Oslo"]
    # A new id is a new turn, which runs (no decision of the reverted turn is replayed).
    lima = await agent.run("Book Lima", session="s1", user="u1", turn_id="req-2")
    assert not lima.replayed and lima.text == "Done: booked Lima"
    assert booked == ["Rome", "Oslo", "Lima"]
