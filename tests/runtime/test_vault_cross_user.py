"""User B's turn never resolves or reveals user A's placeholder, through ``Agent``: B's model
writing ``<EMAIL_1>`` (A's first address, and nothing of B's) gets neither A's value into B's
tool nor into B's reply. Until now only the vault store's conformance suite read across users;
this says it as the leak it would be, at the agent's edge."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from keel.messages import Message, ToolCall
from keel.privacy import MasterKey
from keel.runtime import Agent
from keel.testing import ScriptedCall, ScriptedModel
from keel.tools import tool

ALICE_EMAIL = "alice.a7@example.org"


def _policy(call: ScriptedCall) -> Message | str:
    """Alice gives her address; Bob's model sends a receipt to ``<EMAIL_1>`` and says so."""
    last = call.messages[-1]
    if last.role == "user" and "my email" in last.content.lower():
        return "Noted."
    if last.role == "user":
        arguments = json.dumps({"to": "<EMAIL_1>"})
        return Message.assistant(
            "", tool_calls=[ToolCall(id="c1", name="send_receipt", arguments=arguments)]
        )
    return "Your receipt went to <EMAIL_1>."


async def test_another_users_placeholder_never_resolves_nor_reveals(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KEEL_PII_KEY", MasterKey.new_key_text())
    sent: list[str] = []

    @tool(side_effect=True, idempotent=False)
    def send_receipt(to: str) -> str:
        """Send the receipt.

        Args:
            to: Where it goes.
        """
        sent.append(to)
        return f"sent to {to}"

    agent = Agent.open(
        f"sqlite:///{tmp_path / 'keel.db'}",
        system_prompt="You send receipts.",
        model=ScriptedModel(_policy),
        tools=[send_receipt],
        memory=False,
    )
    try:
        await agent.run(f"My email is {ALICE_EMAIL}", session="s-alice", user="alice")
        reply = await agent.run("Send my receipt.", session="s-bob", user="bob")
        assert ALICE_EMAIL not in sent, f"leak: Bob's tool was given Alice's address ({sent})"
        assert ALICE_EMAIL not in reply.text, (
            f"leak: Bob's reply shows Alice's address: {reply.text!r}"
        )
        # Shown as what it is to Bob: a placeholder keel never placed for him, defanged.
        assert "‹EMAIL_1›" in reply.text, reply.text
        assert sent == [], f"a placeholder Bob does not have was sent as {sent}"
    finally:
        await agent.aclose()
