"""Approvals with the PII vault: a call's placeholders are resolved before the approval policy
reads its arguments, as the executor resolves them before it runs the call. Without that, a
call whose arguments validate only with the real values (an address checked by a pattern)
looked invalid to the approval step, was not held, and then ran without approval once the
executor had resolved its placeholders."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import pytest
from pydantic import Field

from keel.messages import Message, ToolCall
from keel.privacy import MasterKey
from keel.runtime import Agent
from keel.testing import ScriptedModel
from keel.tools import tool

Address = Annotated[str, Field(pattern=r"^[^<>@\s]+@[^<>@\s]+$")]


async def test_a_call_needing_approval_is_held_when_its_arguments_are_placeholders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KEEL_PII_KEY", MasterKey.new_key_text())
    sent: list[str] = []

    @tool(approval=True)
    def send_invoice(to: Address) -> str:
        """Send the invoice.

        Args:
            to: The customer's address.
        """
        sent.append(to)
        return f"sent to {to}"

    call = ToolCall(id="c1", name="send_invoice", arguments=json.dumps({"to": "<EMAIL_1>"}))
    model = ScriptedModel(["Noted.", Message.assistant("", tool_calls=[call]), "Sent."])
    agent = Agent.open(
        f"sqlite:///{tmp_path / 'keel.db'}",
        system_prompt="You bill customers.",
        model=model,
        tools=[send_invoice],
        memory=False,
    )
    try:
        await agent.run("My email is ada@example.com", session="s1", user="u1")
        parked = await agent.run("Send my invoice.", session="s1", user="u1")
        assert sent == [], "the call ran without anyone's approval"
        assert parked.status == "awaiting_approval", parked
        [waiting] = parked.approvals
        # The request holds the placeholder, never the address.
        assert json.loads(waiting.arguments) == {"to": "<EMAIL_1>"}
        decided = await agent.decide("s1", waiting.id, approve=True, by="ops")
        assert decided.status == "completed", decided
        assert sent == ["ada@example.com"], decided.text
    finally:
        await agent.aclose()
