"""Through the Agent: a sync tool declared not ``blocking`` runs on the event loop (no thread
hand-off), and keeps what every tool call has: journalled and run once across a crash, its
failure a result the model reads."""

from __future__ import annotations

import json
import threading

import pytest

from keel.errors import ToolDefinitionError
from keel.messages import Message
from keel.stores import SQLiteDatabase, SQLToolJournal
from keel.testing import ScriptedCall, ScriptedModel
from keel.tools import tool
from tests.runtime.conftest import sqlite_agent


class _Crash(BaseException):
    """The process dies between the tool's effect and the next checkpoint."""


async def test_a_quick_sync_tool_runs_on_the_loop_and_once_across_a_crash(
    database: SQLiteDatabase,
) -> None:
    threads: list[int] = []

    @tool(side_effect=True, idempotent=False, blocking=False)
    def book(ref: str) -> str:
        """Book a seat.

        Args:
            ref: The booking reference.
        """
        threads.append(threading.get_ident())
        return f"BOOKED {ref}"

    def answers(call: ScriptedCall) -> Message | str:
        if call.messages[-1].role == "tool":
            return f"Done: {call.messages[-1].content}"
        return ScriptedModel.tool_call("book", json.dumps({"ref": "R9"}))

    crash = {"armed": True}

    def crashes_after_the_booking(call: ScriptedCall) -> Message | str:
        if call.messages[-1].role == "tool" and crash["armed"]:
            crash["armed"] = False
            raise _Crash
        return answers(call)

    agent = sqlite_agent(database, ScriptedModel(crashes_after_the_booking), tools=[book])
    with pytest.raises(_Crash):
        await agent.handle("s1", "u1", "book R9")
    assert threads == [threading.get_ident()], "the tool did not run on the event loop's thread"
    # A new process: its own Agent on the same database, the same message sent again.
    fresh = sqlite_agent(database, ScriptedModel(answers), tools=[book])
    reply = await fresh.handle("s1", "u1", "book R9")
    assert reply.resumed and reply.status == "completed"
    assert reply.text == "Done: BOOKED R9"
    assert len(threads) == 1, "the journalled booking ran again"
    [entry] = SQLToolJournal(database).entries()
    assert entry.tool == "book" and entry.status == "succeeded"


async def test_a_quick_sync_tool_that_raises_is_a_failed_call_the_model_reads(
    database: SQLiteDatabase,
) -> None:
    @tool(blocking=False)
    def parse(text: str) -> int:
        """Read a number.

        Args:
            text: The digits.
        """
        return int(text)

    def model(call: ScriptedCall) -> Message | str:
        if call.messages[-1].role == "tool":
            return f"tool said: {call.messages[-1].content}"
        return ScriptedModel.tool_call("parse", json.dumps({"text": "twelve"}))

    agent = sqlite_agent(database, ScriptedModel(model), tools=[parse])
    reply = await agent.handle("s1", "u1", "read twelve")
    assert reply.status == "completed"
    assert reply.text.startswith("tool said: ") and "ValueError" in reply.text


def test_blocking_must_be_a_bool() -> None:
    def where() -> str:
        """Say where."""
        return "here"

    with pytest.raises(ToolDefinitionError, match="blocking"):
        tool(blocking="no")(where)  # type: ignore[arg-type]
