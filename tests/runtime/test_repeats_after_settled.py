"""Through the Agent: once a call left in doubt is settled as done (by its own late result, or
by an operator), every repeat of it gets that result; the second repeat as the first.

``keel bench faults`` found it under load (seed 6, booking_timeout): the booking's late result
settled it before the customer's second turn, whose first repeat was answered with it and whose
second repeat booked the order again, because the journalled answer was taken for the newest
run of the call."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from keel.runtime import Agent
from keel.state import AgentState, StateStore
from keel.stores import SQLiteDatabase, SQLStateBackend, SQLToolJournal
from keel.testing import ScriptedModel
from keel.tools import JournalEntry, tool


class _SettledJournal(SQLToolJournal):
    """The SQLite journal, telling the test's loop when a call is settled from outside a turn
    (a late result from the tool's thread, an operator's resolve: both go through ``finish``;
    a turn's own results go through ``afinish``)."""

    def __init__(self, database: SQLiteDatabase, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(database)
        self.loop = loop
        self.settled = asyncio.Event()

    def finish(self, key: str, *, ok: bool, content: str, output: str) -> JournalEntry:
        entry = super().finish(key, ok=ok, content=content, output=output)
        self.loop.call_soon_threadsafe(self.settled.set)
        return entry


@pytest.mark.parametrize("settled_by", ["late_result", "operator"])
async def test_every_repeat_of_a_call_settled_as_done_gets_its_result(
    database: SQLiteDatabase, settled_by: str
) -> None:
    charges: list[int] = []  # the effect itself: one entry per charge the bank made
    release = threading.Event()
    returned = threading.Event()

    @tool(side_effect=True, idempotent=False, timeout_s=0.2)
    def pay(amount: int) -> str:
        """Charge the customer's card.

        Args:
            amount: Amount in cents.
        """
        charges.append(amount)
        if len(charges) == 1:
            release.wait(30)  # the bank charged at once; its answer comes after the timeout
            returned.set()
        return f"charged {amount}, receipt R{len(charges)}"

    charge = ScriptedModel.tool_call("pay", json.dumps({"amount": 5000}))
    # Turn 2: the model asks twice for the charge it was told was in doubt.
    model = ScriptedModel([charge, charge, charge, "Your card was charged once."])
    journal = _SettledJournal(database, asyncio.get_running_loop())
    agent = Agent(
        model,
        state=StateStore(SQLStateBackend(database), AgentState),
        system_prompt="You take payments.",
        tools=[pay],
        journal=journal,
    )
    try:
        first = await agent.handle("s1", "u1", "Charge me 50 euros.")
        assert first.status == "tool_in_doubt" and charges == [5000]
        if settled_by == "late_result":
            release.set()
        else:
            (doubtful,) = journal.in_doubt(agent.session_key("s1"))
            journal.resolve(doubtful.key, ok=True, content="charged 5000, receipt R1")
        await journal.settled.wait()
        assert journal.in_doubt() == []

        again = await agent.handle("s1", "u1", "Did it go through? Charge me 50 euros.")

        assert charges == [5000], "a repeat of a call settled as done charged the card again"
        assert again.status == "completed" and again.text == "Your card was charged once."
        state = agent.session_state("s1")
        assert state is not None
        repeats = [m.content for m in state.messages if m.role == "tool"][-2:]
        assert all("Not run again" in text and "receipt R1" in text for text in repeats)
    finally:
        release.set()
        # The abandoned thread ends (and journals nothing more) before the database closes.
        await asyncio.to_thread(returned.wait, 10)
        await agent.aclose()
