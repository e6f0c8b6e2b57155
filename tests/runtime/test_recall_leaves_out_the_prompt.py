"""A memory-on turn recalls nothing its prompt already shows: not its session's running summary
(archived to memory, and in the prompt as the summary block), not a turn still in its window
(shown verbatim), not even as a neighbour of a hit. Other sessions' memories, and the session's
turns that left the window, are still recalled.

Seen where the model sees it: the prompt a scripted model was sent. Every turn of the session
carries a word of its own (``zephyr007``), so the memories block shows which turns it holds.
"""

from __future__ import annotations

import re

from keel.context import ContextBudget
from keel.context._engine import MEMORIES_HEADING, SUMMARY_HEADING
from keel.memory import HashingEmbedder, Memory
from keel.messages import Message
from keel.runtime import Agent
from keel.state import AgentState, StateStore
from keel.stores import SQLiteDatabase, SQLiteMemoryStore, SQLStateBackend
from keel.testing import ScriptedModel

_MARK = re.compile(r"zephyr(\d{3})")


def _note(turn: int) -> str:
    return f"Note zephyr{turn:03d}: shelf {turn} holds a box. " + "padding " * 60


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
    model = ScriptedModel(lambda call: "Noted.")
    agent = Agent(
        model,
        state=StateStore(SQLStateBackend(database), AgentState),
        system_prompt="You help.",
        memory=memory,
        memory_budget_tokens=1_500,
        context=ContextBudget(working_budget=4_000, memories_cap=1_500),
    )
    await agent.handle("s0", "ada", "My locker code is 4417.")
    for turn in range(1, 41):
        await agent.handle("s1", "ada", _note(turn))
        memory.flush()  # each turn's records searchable by the next, as the outbox would
    # The window the next recall leaves out is the one the last prompt showed.
    shown = _window_turns(model.calls[-1].messages)
    first = min(shown)
    asked = " ".join(f"zephyr{turn:03d}" for turn in range(first - 3, first + 3))
    await agent.handle("s1", "ada", f"What is my locker code, and what did {asked} say?")

    prompt = model.calls[-1].messages
    window = _window_turns(prompt)
    summary = agent.session_state("s1").runtime.summary  # type: ignore[union-attr]
    recalled = _block(prompt, MEMORIES_HEADING)
    # The test means something: a summary was archived, turns left the window, and the turn
    # before the window and the window's first are among those asked about.
    assert summary and _block(prompt, SUMMARY_HEADING)
    assert min(window) == first and len(window) < 40
    in_window = {int(found) for found in _MARK.findall(recalled)} & set(window)
    assert not in_window, f"turns {sorted(in_window)} are in the window and recalled too"
    # The session's own summary is not recalled: no line of it is in the memories block.
    lines = [line for line in summary.splitlines() if "zephyr" in line]
    assert lines and not any(line.strip("- ") in recalled for line in lines)
    # Still recalled: another session's fact, and the session's turn that left the window.
    assert "4417" in recalled
    assert f"zephyr{first - 1:03d}" in recalled
    await agent.aclose()
    memory.close()
