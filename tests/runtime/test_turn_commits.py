"""A turn's trace commits with its checkpoints: one commit for both, and never at their cost.

The trace a turn has recorded so far rides the checkpoint before each model call, and the
run's end rides the turn's last checkpoint, in the same SQLite transaction (a savepoint of it):
a process killed during the model call leaves both at the same point, and the turn pays one
commit where it paid two. A trace that cannot be written is logged and dropped as before; it
never undoes the checkpoint it rode with.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path

from keel.messages import Message
from keel.runtime import Agent
from keel.settings import load_settings
from keel.stores import SQLiteDatabase
from keel.testing import ScriptedCall, ScriptedModel
from keel.tools import tool


@tool
def lookup(query: str) -> str:
    """Look records up.

    Args:
        query: What to look up.
    """
    return f"the record for {query}"


def _policy(call: ScriptedCall) -> Message | str:
    if call.messages[-1].role == "tool":
        return "Here it is."
    return ScriptedModel.tool_call("lookup", json.dumps({"query": call.last_user_text[-12:]}))


def _agent(directory: Path) -> Agent:
    """The ``keel bench turns`` agent (memory off): one tool call and one answer a turn."""
    return Agent.open(
        None,
        settings=load_settings(data_dir=directory, embedder="hashing:64"),
        model=ScriptedModel(_policy),
        system_prompt="You look records up.",
        tools=[lookup],
        memory=False,
    )


def _database(agent: Agent) -> SQLiteDatabase:
    assert agent.backends is not None
    sql = agent.backends._sql
    assert isinstance(sql, SQLiteDatabase)
    return sql


_WRITES = ("INSERT", "UPDATE", "DELETE", "REPLACE")


@contextlib.contextmanager
def _counting_commits(db: SQLiteDatabase) -> Iterator[list[int]]:
    """The commits ``db``'s connections make inside the block, counted as SQLite sees them:
    each ``COMMIT``, and each write statement run outside a transaction (in autocommit, a
    transaction of its own)."""
    counted = [0]
    connection = db.connection
    traced: list[sqlite3.Connection] = []

    def trace(conn: sqlite3.Connection) -> None:
        def seen(sql: str) -> None:
            word = sql.lstrip().split(None, 1)[0].upper()
            if word == "COMMIT" or (word in _WRITES and not conn.in_transaction):
                counted[0] += 1

        conn.set_trace_callback(seen)
        traced.append(conn)

    def counting() -> sqlite3.Connection:
        conn = connection()
        if conn not in traced:
            trace(conn)
        return conn

    db.connection = counting  # type: ignore[method-assign]
    try:
        yield counted
    finally:
        del db.connection
        for conn in traced:
            conn.set_trace_callback(None)


def test_a_turn_writes_its_trace_in_its_checkpoints_transactions(tmp_path: Path) -> None:
    agent = _agent(tmp_path)
    try:
        agent.handle_sync("s1", "u1", "warm up")
        with _counting_commits(_database(agent)) as commits:
            reply = agent.handle_sync("s1", "u1", "find the record")
        assert reply.status == "completed"
        # The session's lease taken and given back, and three checkpoints (before each of the
        # two model calls, and the commit) that carry the trace: no commit of the trace alone.
        assert commits[0] == 5
        assert agent.tracer.store is not None
        run = agent.tracer.store.get_run(reply.run_id)
        assert run is not None
        assert run.status == "succeeded"
        assert (run.model_calls, run.tool_calls) == (2, 1)
        steps = agent.tracer.store.get_run_detail(reply.run_id)
        assert steps is not None
        assert [step.kind for step in steps.steps] == ["model", "tool", "model"]
    finally:
        agent.close()


def test_a_trace_that_cannot_be_written_never_undoes_the_checkpoint(tmp_path: Path) -> None:
    agent = _agent(tmp_path)
    try:
        agent.handle_sync("s1", "u1", "warm up")
        path = _database(agent).path
        with sqlite3.connect(path) as conn:
            conn.execute(
                "CREATE TRIGGER no_steps BEFORE INSERT ON trace_steps "
                "BEGIN SELECT RAISE(ABORT, 'trace steps refused'); END"
            )
        reply = agent.handle_sync("s1", "u1", "find the record")
        assert reply.status == "completed"
        assert reply.text == "Here it is."
        # A second agent on the file reads the turn from the store: every checkpoint landed.
        other = _agent(tmp_path)
        try:
            stored = other.state.load(other.session_key("s1")).state
        finally:
            other.close()
        last = stored.messages[-4:]
        assert [m.role for m in last] == ["user", "assistant", "tool", "assistant"]
        assert (last[0].content, last[-1].content) == ("find the record", "Here it is.")
        assert stored.runtime.open_turn is None
        # The trace's batches were dropped (logged), as a failed flush's are.
        assert agent.tracer.store is not None
        detail = agent.tracer.store.get_run_detail(reply.run_id)
        assert detail is None or not detail.steps
    finally:
        agent.close()
