"""A tool call's arguments reach the journal and the approval queue masked whatever characters
they hold: an address with accents, a card in fullwidth digits. JSON's ``\\u`` escapes
(``j\\u00f6rg@...``) would hide them from every detector, and they would be stored as they are.
A tool that never sees personal data (the workflow's ``remember``) gets a value the model wrote
masked, so the session's state never holds it."""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from keel.messages import Message, ToolCall
from keel.runtime import Agent
from keel.settings import load_settings
from keel.state import MachineState, StateMachine, Transition
from keel.testing import ScriptedCall, ScriptedModel
from keel.tools import NestedArgumentsWarning, tool
from tests.privacy._samples import dump_sqlite, leaks

EMAIL = "jörg.müller@bücher.example"
CARD = "４１１１ １１１１ １１１１ １１１１"
# Each value as it is, and as JSON with ASCII escapes writes it.
VALUES = {
    "EMAIL": EMAIL,
    "CREDIT_CARD": CARD,
    "EMAIL (escaped)": json.dumps(EMAIL)[1:-1],
    "CREDIT_CARD (escaped)": json.dumps(CARD)[1:-1],
}
sent: list[tuple[str, str]] = []


@tool(side_effect=True, idempotent=False)
def send_receipt(to: str, card: str) -> str:
    """Mail a receipt for a card payment.

    Args:
        to: The customer's address.
        card: The card charged.
    """
    sent.append((to, card))
    return "receipt sent"


@tool(approval=True, side_effect=True)
def refund(to: str, card: str) -> str:
    """Refund a card payment.

    Args:
        to: The customer's address.
        card: The card to refund.
    """
    return "refunded"


def _call(name: str) -> Message:
    # The model writes the characters as they are (no escapes): keel's own JSON must too.
    arguments = json.dumps({"to": EMAIL, "card": CARD}, ensure_ascii=False)
    return Message.assistant("", tool_calls=[ToolCall(id="c1", name=name, arguments=arguments)])


def _model(name: str) -> ScriptedModel:
    def reply(call: ScriptedCall) -> Message | str:
        return "Done." if any(m.role == "tool" for m in call.messages) else _call(name)

    return ScriptedModel(reply)


@pytest.fixture
def database(tmp_path: Path) -> Iterator[Path]:
    sent.clear()
    yield tmp_path / "keel.db"


def _open(database: Path, name: str) -> Agent:
    return Agent.open(
        f"sqlite:///{database}",
        system_prompt="You send receipts and refund payments.",
        model=_model(name),
        tools=[send_receipt, refund],
        memory=False,
    )


def _masked(arguments: str) -> dict[str, Any]:
    values: dict[str, Any] = json.loads(arguments)
    return values


async def test_a_journalled_call_holds_no_accented_address_nor_fullwidth_card(
    database: Path,
) -> None:
    agent = _open(database, "send_receipt")
    try:
        reply = await agent.run("Send my receipt.", session="s1", user="u1")
    finally:
        await agent.aclose()
    assert reply.status == "completed", reply
    # The tool got the values as the model wrote them.
    assert sent == [(EMAIL, CARD)]
    dumped = dump_sqlite(database)
    assert "send_receipt" in dumped["keel_tool_journal"]
    assert leaks(dumped, VALUES) == []


async def test_an_approval_request_holds_no_accented_address_nor_fullwidth_card(
    database: Path,
) -> None:
    agent = _open(database, "refund")
    try:
        parked = await agent.run("Refund me.", session="s1", user="u1")
    finally:
        await agent.aclose()
    assert parked.status == "awaiting_approval", parked
    [waiting] = parked.approvals
    asked = _masked(waiting.arguments)
    assert asked["to"].startswith("<EMAIL_") and asked["card"].startswith("<CREDIT_CARD_")
    assert leaks(dump_sqlite(database), VALUES) == []


def _slots_machine() -> StateMachine:
    return StateMachine(
        "receipts",
        states=[
            MachineState("open", "taking details", "Take the details.", ("email",)),
            MachineState("done", "done", "Say goodbye.", (), terminal=True),
        ],
        transitions=[Transition("open", "done")],
        initial="open",
    )


@pytest.mark.parametrize("email", [EMAIL, "mallory.x7q@example.org"])
async def test_a_value_the_model_remembers_in_a_slot_is_kept_masked(
    database: Path, email: str
) -> None:
    def reply(call: ScriptedCall) -> Message | str:
        if any(m.role == "tool" for m in call.messages):
            return "Noted."
        arguments = json.dumps({"slot": "email", "value": email}, ensure_ascii=False)
        call_message = ToolCall(id="c1", name="remember", arguments=arguments)
        return Message.assistant("", tool_calls=[call_message])

    agent = Agent.open(
        f"sqlite:///{database}",
        system_prompt="You take details.",
        model=ScriptedModel(reply),
        machine=_slots_machine(),
        memory=False,
    )
    try:
        reply_to_user = await agent.run("Note my address.", session="s1", user="u1")
        state = agent.session_state("s1")
    finally:
        await agent.aclose()
    assert reply_to_user.status == "completed", reply_to_user
    assert state is not None and state.machine is not None
    assert state.machine.slots["email"].startswith("<EMAIL_")
    dumped = dump_sqlite(database)
    assert leaks(dumped, {"EMAIL": email, "EMAIL (escaped)": json.dumps(email)[1:-1]}) == []


seen_by_tagger: list[tuple[dict[str, str], int]] = []


def _tag_contacts(labels: dict[str, str], account: int) -> str:
    """Tag contacts of an account.

    Args:
        labels: Each contact's label.
        account: The account's number.
    """
    seen_by_tagger.append((labels, account))
    return "tagged"


with warnings.catch_warnings():  # an object argument is the point: its keys are texts
    warnings.simplefilter("ignore", NestedArgumentsWarning)
    tag_contacts = tool(sees_values=False, name="tag_contacts")(_tag_contacts)


@pytest.mark.parametrize(
    ("arguments", "reaches_the_tool"),
    [
        # An address as an object's key: masked as the values are.
        ({"labels": {"mallory.x7q@example.org": "vip"}, "account": 7}, True),
        # A card number written as a number: its placeholder is no int, the call is refused.
        ({"labels": {}, "account": 4111111111111111}, False),
    ],
)
async def test_a_tool_that_sees_no_values_gets_no_key_nor_number_the_model_wrote(
    database: Path, arguments: dict[str, Any], reaches_the_tool: bool
) -> None:
    seen_by_tagger.clear()

    def reply(call: ScriptedCall) -> Message | str:
        if any(m.role == "tool" for m in call.messages):
            return "Done."
        written = ToolCall(id="c1", name="tag_contacts", arguments=json.dumps(arguments))
        return Message.assistant("", tool_calls=[written])

    agent = Agent.open(
        f"sqlite:///{database}",
        system_prompt="You tag contacts.",
        model=ScriptedModel(reply),
        tools=[tag_contacts],
        memory=False,
    )
    try:
        reply_to_user = await agent.run("Tag my contacts.", session="s1", user="u1")
    finally:
        await agent.aclose()
    assert reply_to_user.status == "completed", reply_to_user
    seen = repr(seen_by_tagger)
    assert "mallory.x7q@example.org" not in seen and "4111111111111111" not in seen, seen
    assert bool(seen_by_tagger) is reaches_the_tool, seen
    if reaches_the_tool:
        assert [*seen_by_tagger[0][0]] == ["<EMAIL_1>"], seen


async def test_a_lone_surrogate_in_a_calls_arguments_does_not_fail_the_turn(
    database: Path,
) -> None:
    # A model's JSON may hold half of an emoji's escape pair ("\ud83d"): it reads as a lone
    # surrogate, which UTF-8 cannot encode. Written as it is (not escaped), the journal's
    # arguments made the store raise, and the turn failed.
    def reply(call: ScriptedCall) -> Message | str:
        if any(m.role == "tool" for m in call.messages):
            return "Done."
        arguments = '{"to": "mallory.x7q@example.org", "card": "thanks \\ud83d"}'
        written = ToolCall(id="c1", name="send_receipt", arguments=arguments)
        return Message.assistant("", tool_calls=[written])

    agent = Agent.open(
        f"sqlite:///{database}",
        system_prompt="You send receipts.",
        model=ScriptedModel(reply),
        tools=[send_receipt],
        memory=False,
    )
    try:
        reply_to_user = await agent.run("Send my receipt.", session="s1", user="u1")
    finally:
        await agent.aclose()
    assert reply_to_user.status == "completed", reply_to_user
    assert sent == [("mallory.x7q@example.org", "thanks \ud83d")]
    assert "mallory.x7q" not in dump_sqlite(database)["keel_tool_journal"]


async def test_two_values_the_model_wrote_for_a_tool_that_sees_none_get_two_placeholders(
    database: Path,
) -> None:
    # Without a vault a masker numbers placeholders per text: each string masked alone made
    # both addresses <EMAIL_1> (one value told twice), and, as keys, one entry of two.
    seen_by_tagger.clear()
    arguments = {
        "labels": {"mallory.x7q@example.org": "vip", "trent.k4v@example.net": "churned"},
        "account": 7,
    }

    def reply(call: ScriptedCall) -> Message | str:
        if any(m.role == "tool" for m in call.messages):
            return "Done."
        written = ToolCall(id="c1", name="tag_contacts", arguments=json.dumps(arguments))
        return Message.assistant("", tool_calls=[written])

    agent = Agent.open(
        f"sqlite:///{database}",
        system_prompt="You tag contacts.",
        model=ScriptedModel(reply),
        tools=[tag_contacts],
        memory=False,
        settings=load_settings(data_dir=database.parent, pii_vault=False),
    )
    try:
        reply_to_user = await agent.run("Tag my contacts.", session="s1", user="u1")
    finally:
        await agent.aclose()
    assert reply_to_user.status == "completed", reply_to_user
    assert seen_by_tagger == [({"<EMAIL_1>": "vip", "<EMAIL_2>": "churned"}, 7)], seen_by_tagger
