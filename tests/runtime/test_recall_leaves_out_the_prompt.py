"""A memory-on turn recalls nothing its prompt already shows: not its session's running summary
(archived to memory, and in the prompt as the summary block), not a turn still in its window
(shown verbatim), not even as a neighbour of a hit. Other sessions' memories, and the session's
turns that left the window, are still recalled.

Seen where the model sees it: the prompt a scripted model was sent. Every turn of the session
carries a word of its own (``zephyr007``), so the memories block shows which turns it holds.
"""

from __future__ import annotations

import json
import re

from keel.context import ContextBudget
from keel.context._engine import MEMORIES_HEADING, SUMMARY_HEADING
from keel.memory import HashingEmbedder, Memory
from keel.messages import Message
from keel.runtime import Agent
from keel.state import AgentState, StateStore
from keel.stores import SQLiteDatabase, SQLiteMemoryStore, SQLStateBackend
from keel.testing import ScriptedCall, ScriptedModel
from keel.tools import tool

_MARK = re.compile(r"zephyr(\d{3})")


@tool
def shelf(number: int) -> str:
    """Read a shelf's inventory.

    Args:
        number: The shelf.
    """
    # Long output: the window fills (and the summary starts) within a few turns, while the
    # turns memory keeps (the user's words and the reply) stay short.
    return f"Shelf {number}: " + "crate " * 300


def _policy(call: ScriptedCall) -> Message | str:
    if call.messages[-1].role == "tool":
        return "Noted."
    found = _MARK.search(call.last_user_text)
    number = int(found.group(1)) if found else 0
    return ScriptedModel.tool_call("shelf", json.dumps({"number": number}))


def _note(turn: int) -> str:
    return f"Note zephyr{turn:03d}: shelf {turn} holds a box."


def _block(prompt: list[Message], heading: str) -> str:
    return next((m.content for m in prompt if m.role == "system" and heading in m.content), "")


def _window_turns(prompt: list[Message]) -> list[int]:
    """The session's turns whose user message the prompt's window shows."""
    return [
        int(found)
        for m in prompt
        if m.role == "user"
        for found in _MARK.findall(m.content)
        if m.content.startswith("Note ")
    ]


async def test_recall_leaves_out_the_sessions_summary_and_the_turns_in_its_window(
    database: SQLiteDatabase,
) -> None:
    memory = Memory(SQLiteMemoryStore(database), embedder=HashingEmbedder(dimension=64))
    model = ScriptedModel(_policy)
    agent = Agent(
        model,
        state=StateStore(SQLStateBackend(database), AgentState),
        system_prompt="You help.",
        tools=[shelf],
        memory=memory,
        context=ContextBudget(working_budget=8_000, summary_cap=250),
    )
    await agent.handle("s0", "ada", "My locker code is 4417.")
    for turn in range(1, 31):
        await agent.handle("s1", "ada", _note(turn))
        memory.flush()  # each turn's records searchable by the next, as the outbox would
    # The window the next prompt shows starts about where the last one did (a summary at the
    # end of the last turn may move it on): the question names the turns around its start.
    near = min(_window_turns(model.calls[-1].messages))
    asked = range(near - 3, near + 4)
    names = " ".join(f"zephyr{turn:03d}" for turn in asked)
    await agent.handle("s1", "ada", f"What is my locker code, and what did {names} say?")

    prompt = model.calls[-1].messages
    window = _window_turns(prompt)
    first = min(window)
    summary = _block(prompt, SUMMARY_HEADING)
    recalled = _block(prompt, MEMORIES_HEADING)
    # The test means something: a summary was archived, turns left the window, and the turn
    # before the window and the window's first are among those asked about.
    assert summary and "zephyr" in summary
    assert first - 1 in asked and first in asked and len(window) < 30
    in_window = {int(found) for found in _MARK.findall(recalled)} & set(window)
    assert not in_window, f"turns {sorted(in_window)} are in the window and recalled too"
    # The session's own summary, in the prompt, is not recalled: no line of it is among the
    # memories (its turns are, as what the user said: "User: Note ...", not "User said: ...").
    lines = [line for line in summary.splitlines() if "zephyr" in line]
    assert not any(line in recalled for line in lines)
    # Still recalled: another session's fact, and the session's turn that left the window.
    assert "4417" in recalled
    assert f"zephyr{first - 1:03d}" in recalled
    await agent.aclose()
    memory.close()
