"""Through the Agent: a booking that outlives its timeout is in doubt and is never run twice."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

from keel.runtime import Agent
from keel.testing import ScriptedModel
from keel.tools import tool

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _in_doubt_listed() -> list[dict[str, object]]:
    result = subprocess.run(
        [sys.executable, "-m", "keel", "tools", "in-doubt", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])},
    )
    assert result.returncode == 0, result.stderr
    entries: list[dict[str, object]] = json.loads(result.stdout.strip().splitlines()[-1])[
        "in_doubt"
    ]
    return entries


async def test_a_timed_out_booking_is_in_doubt_and_the_model_cannot_book_it_again() -> None:
    effects: list[int] = []
    release = threading.Event()
    answered = threading.Event()

    @tool(side_effect=True, idempotent=False, timeout_s=0.2)
    def pay(amount: int) -> str:
        """Charge the customer's card.

        Args:
            amount: Amount in cents.
        """
        effects.append(amount)  # the charge happens; the bank's answer is slow
        release.wait(30)
        answered.set()
        return f"charged {amount}, receipt R1"

    charge = ScriptedModel.tool_call("pay", json.dumps({"amount": 5000}))
    model = ScriptedModel([charge, charge, charge, "Your card was charged once."])
    agent = Agent.embedded(model, system_prompt="You take payments.", tools=[pay], memory=False)
    try:
        first = await agent.handle("s1", "u1", "Charge me 50 euros.")
        assert first.status == "tool_in_doubt" and effects == [5000]
        listed = _in_doubt_listed()
        assert [entry["tool"] for entry in listed] == ["pay"]
        # The user insists; the model calls again with the same arguments: not run again.
        second = await agent.handle("s1", "u1", "Did it go through? Charge me 50 euros.")
        assert second.status == "tool_in_doubt"
        assert str(listed[0]["key"]) in (second.error or "")
        assert effects == [5000]
        assert [entry["key"] for entry in _in_doubt_listed()] == [listed[0]["key"]]
        # The bank answers at last: the journal records it, and the call is settled.
        release.set()
        for _ in range(200):
            if not agent.journal or not agent.journal.in_doubt(agent.session_key("s1")):
                break
            await asyncio.sleep(0.025)
        assert _in_doubt_listed() == []
        # A third request gets the recorded result instead of a second charge.
        third = await agent.handle("s1", "u1", "Charge me 50 euros, please.")
        assert third.status == "completed" and third.text == "Your card was charged once."
        assert effects == [5000]
        state = agent.session_state("s1")
        assert state is not None
        tool_texts = [m.content for m in state.messages if m.role == "tool"]
        assert any("charged 5000, receipt R1" in text for text in tool_texts)
    finally:
        release.set()
        # Let the abandoned thread finish and journal its result before the database closes.
        answered.wait(10)
        await asyncio.sleep(0.2)
        await agent.aclose()


async def test_a_booking_an_operator_settled_is_not_run_again_when_the_model_asks_again() -> None:
    # τ²-bench's retail through keel found it: the turn ends in doubt, an operator settles the
    # call as done from the store's records, and the customer's "carry on" makes the model ask
    # for the same booking again; it must get the operator's answer, not a second booking.
    effects: list[int] = []
    release = threading.Event()

    @tool(side_effect=True, idempotent=False, timeout_s=0.2)
    def pay(amount: int) -> str:
        """Charge the customer's card.

        Args:
            amount: Amount in cents.
        """
        effects.append(amount)
        release.wait(30)
        return f"charged {amount}"

    charge = ScriptedModel.tool_call("pay", json.dumps({"amount": 5000}))
    model = ScriptedModel([charge, charge, "Your card was charged once."])
    agent = Agent.embedded(model, system_prompt="You take payments.", tools=[pay], memory=False)
    try:
        first = await agent.handle("s1", "u1", "Charge me 50 euros.")
        assert first.status == "tool_in_doubt" and effects == [5000]
        assert agent.journal is not None
        (doubtful,) = agent.journal.in_doubt(agent.session_key("s1"))
        agent.journal.resolve(doubtful.key, ok=True, content="charged 5000, receipt R7 (checked)")
        again = await agent.handle("s1", "u1", "Could you check and carry on?")
        assert again.status == "completed" and effects == [5000]
        state = agent.session_state("s1")
        assert state is not None
        last_tool = [m.content for m in state.messages if m.role == "tool"][-1]
        assert "receipt R7 (checked)" in last_tool and "Not run again" in last_tool
    finally:
        release.set()
        await asyncio.sleep(0.2)
        await agent.aclose()
