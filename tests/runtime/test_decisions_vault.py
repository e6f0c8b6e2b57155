"""A decision on a waiting call is masked through the vault of the request's user (issue 44,
defect 1): corrected arguments and an operator's note number their values as the user's turns
do. Masked per text, an operator's new address became ``<EMAIL_1>``, the user's *other*
stored address, and the tool sent the receipt there; for a user with no stored values the
call could not be resolved and never ran, though the request said approved."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import BaseModel

from keel.messages import Message, ToolCall
from keel.privacy import MasterKey
from keel.runtime import Agent
from keel.testing import ScriptedModel
from keel.tools import Tool, tool


def _receipt_tool(sent: list[str]) -> Tool:
    @tool(approval=True)
    def send_receipt(to: str) -> str:
        """Send the receipt.

        Args:
            to: Where it goes.
        """
        sent.append(to)
        return f"sent to {to}"

    return send_receipt


def _agent(tmp_path: Path, model: ScriptedModel, sent: list[str], **options: object) -> Agent:
    return Agent.open(
        f"sqlite:///{tmp_path / 'keel.db'}",
        system_prompt="You send receipts.",
        model=model,
        tools=[_receipt_tool(sent)],
        memory=False,
        **options,  # type: ignore[arg-type]
    )


def _call(to: str) -> Message:
    call = ToolCall(id="c1", name="send_receipt", arguments=json.dumps({"to": to}))
    return Message.assistant("", tool_calls=[call])


@pytest.fixture(autouse=True)
def _vault_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEEL_PII_KEY", MasterKey.new_key_text())


async def test_corrected_arguments_reach_the_tool_as_the_operator_wrote_them(
    tmp_path: Path,
) -> None:
    sent: list[str] = []
    model = ScriptedModel(["Noted.", _call("<EMAIL_1>"), "Sent."])
    agent = _agent(tmp_path, model, sent)
    try:
        await agent.run("My email is ada@example.com", session="s1", user="u1")
        parked = await agent.run("Send my receipt.", session="s1", user="u1")
        [waiting] = parked.approvals
        note = "moved to billing, see #11 ops@corp.example"
        decided = await agent.decide(
            "s1",
            waiting.id,
            approve=True,
            by="ops",
            note=note,
            arguments=json.dumps({"to": "billing@newco.example"}),
        )
        assert decided.status == "completed", decided
        assert sent == ["billing@newco.example"], (
            f"the tool received {sent}, not the operator's correction"
        )
        assert agent.approvals is not None and agent.vault is not None
        stored = await agent.approvals.store.aget(agent.tenant_id, waiting.id)
        assert stored is not None and stored.decision is not None
        decision = stored.decision
        # Stored masked, and the user's own placeholders read back as what was written.
        assert "billing@newco.example" not in (decision.arguments or "")
        assert "ops@corp.example" not in (decision.note or "")
        user_vault = agent.vault.user(agent.tenant_id, "u1")
        assert json.loads(user_vault.reveal(decision.arguments or "")) == {
            "to": "billing@newco.example"
        }
        assert user_vault.reveal(decision.note or "") == note
    finally:
        await agent.aclose()


async def test_a_correction_for_a_user_with_no_stored_values_runs(tmp_path: Path) -> None:
    sent: list[str] = []
    model = ScriptedModel([_call("the usual place"), "Sent."])
    agent = _agent(tmp_path, model, sent)
    try:
        parked = await agent.run("Send my receipt.", session="s1", user="fresh")
        [waiting] = parked.approvals
        decided = await agent.decide(
            "s1",
            waiting.id,
            approve=True,
            by="ops",
            arguments=json.dumps({"to": "billing@newco.example"}),
        )
        assert sent == ["billing@newco.example"], (
            f"approved, but the corrected call ran with {sent} ({decided.status}: {decided.text})"
        )
        assert decided.status == "completed", decided
    finally:
        await agent.aclose()


async def test_a_user_confirming_masks_through_their_own_vault_not_the_deciders_name(
    tmp_path: Path,
) -> None:
    """The user's confirmation with a correction: numbered in the request's user's vault."""
    sent: list[str] = []

    @tool(approval="user")
    def send_receipt(to: str) -> str:
        """Send the receipt.

        Args:
            to: Where it goes.
        """
        sent.append(to)
        return f"sent to {to}"

    model = ScriptedModel(["Noted.", _call("<EMAIL_1>"), "Sent."])
    agent = Agent.open(
        f"sqlite:///{tmp_path / 'keel.db'}",
        system_prompt="You send receipts.",
        model=model,
        tools=[send_receipt],
        memory=False,
    )
    try:
        await agent.run("My email is ada@example.com", session="s1", user="u1")
        parked = await agent.run("Send my receipt.", session="s1", user="u1")
        [waiting] = parked.approvals
        decided = await agent.decide(
            "s1",
            waiting.id,
            approve=True,
            user_id="u1",
            arguments=json.dumps({"to": "billing@newco.example"}),
        )
        assert decided.status == "completed", decided
        assert sent == ["billing@newco.example"], sent
    finally:
        await agent.aclose()


class Receipt(BaseModel):
    to: str
    notes: list[str]


async def test_a_decider_who_may_not_read_values_gets_the_reply_as_stored(
    tmp_path: Path,
) -> None:
    """``reveal=False`` (an operator not granted values): the resumed turn's reply is the one
    the turn stored, never revealed, so no value comes back for a masker to miss; its
    structured answer is masked as its text is. By default the decider reads the values."""
    sent: list[str] = []
    answer = json.dumps({"to": "<EMAIL_1>", "notes": ["sent to <EMAIL_1>", "<PHONE_9>"]})
    model = ScriptedModel(
        ["Noted.", _call("<EMAIL_1>"), answer, "Noted.", _call("<EMAIL_1>"), answer]
    )
    agent = _agent(tmp_path, model, sent, output_type=Receipt)
    try:
        replies = []
        for session, reveal in (("s1", False), ("s2", True)):
            await agent.run("My email is ada@example.com", session=session, user="u1")
            parked = await agent.run("Send my receipt.", session=session, user="u1")
            [waiting] = parked.approvals
            if reveal:
                replies.append(await agent.decide(session, waiting.id, approve=True, by="ops"))
            else:
                replies.append(
                    await agent.decide(session, waiting.id, approve=True, by="ops", reveal=False)
                )
    finally:
        await agent.aclose()
    hidden, shown = replies
    assert sent == ["ada@example.com", "ada@example.com"]
    assert hidden.status == shown.status == "completed", replies
    assert "ada@example.com" not in hidden.model_dump_json()
    assert '"<EMAIL_1>"' in hidden.text
    # What the model wrote that keel never placed stays defanged, as stored.
    assert hidden.output.to == "<EMAIL_1>" and hidden.output.notes[0] == "sent to <EMAIL_1>"
    assert hidden.output.notes[1] != "<PHONE_9>"
    assert shown.output == Receipt(
        to="ada@example.com", notes=["sent to ada@example.com", "<PHONE_9>"]
    )
