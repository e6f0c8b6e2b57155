"""Values with invisible format characters inside them (a zero-width space in an address, a
zero-width non-joiner in a phone number, a soft hyphen, word joiner or byte order mark in a
card: pasted so, or written so to slip past the masker) never reach the database raw: not the
session's messages, the tool journal, the traces nor the memory. The user writes some, the
model others (in its reply and in a tool call's arguments)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from keel.messages import Message, ToolCall
from keel.runtime import Agent, TextDelta
from keel.stores import SQLiteDatabase
from keel.testing import ScriptedCall, ScriptedModel
from keel.tools import tool
from tests.privacy._samples import dump_sqlite, leaks
from tests.runtime.conftest import sqlite_agent

USER_VALUES = {
    "EMAIL": "mallory.z3k\u200b@example.org",
    "PHONE": "+1 415\u200c555 0132",
    "CREDIT_CARD": "4111\u00ad1111 1111\u20601111",
}
MODEL_VALUES = {
    "EMAIL": "peggy.q8v@exam\u200dple.com",
    "CREDIT_CARD": "4012\ufeff8888 8888 1881",
}
INVISIBLE = "\u200b\u200c\u200d\u00ad\u2060\ufeff"
sent: list[str] = []


@tool(side_effect=True, idempotent=False)
def send_receipt(to: str, card: str) -> str:
    """Mail a receipt for a card payment.

    Args:
        to: The customer's address.
        card: The card charged.
    """
    sent.append(to)
    return "receipt sent"


def _reply(call: ScriptedCall) -> Message | str:
    if any(m.role == "tool" for m in call.messages):
        return f"Sent to {MODEL_VALUES['EMAIL']} for card {MODEL_VALUES['CREDIT_CARD']}."
    arguments = json.dumps(
        {"to": MODEL_VALUES["EMAIL"], "card": MODEL_VALUES["CREDIT_CARD"]}, ensure_ascii=False
    )
    return Message.assistant(
        "", tool_calls=[ToolCall(id="c1", name="send_receipt", arguments=arguments)]
    )


def _forms(value: str) -> set[str]:
    """The value as written, as JSON's ASCII escapes write it, and without its invisible
    characters (or its spaces): each is the same leak."""
    bare = "".join(char for char in value if char not in INVISIBLE)
    return {value, json.dumps(value)[1:-1], bare, bare.replace(" ", "")}


@pytest.fixture
def database(tmp_path: Path) -> Iterator[Path]:
    sent.clear()
    yield tmp_path / "keel.db"


async def test_values_with_invisible_characters_never_reach_the_database(
    database: Path,
) -> None:
    agent = Agent.open(
        f"sqlite:///{database}",
        system_prompt="You send receipts.",
        model=ScriptedModel(_reply),
        tools=[send_receipt],
        memory=True,
    )
    try:
        said = ", ".join(USER_VALUES.values())
        reply = await agent.run(f"Send my receipt; me: {said}", session="s1", user="u1")
    finally:
        await agent.aclose()
    assert reply.status == "completed", reply
    assert sent == [MODEL_VALUES["EMAIL"]]  # the tool got the value as the model wrote it
    dumped = dump_sqlite(database)
    assert "send_receipt" in dumped["keel_tool_journal"]
    assert any(table.startswith("trace") for table in dumped)
    leaked = leaks(dumped, USER_VALUES, MODEL_VALUES, forms=_forms)
    assert leaked == []
    # The memory was written (masked): the values were in what it stores.
    assert any("memor" in table and "<EMAIL_" in text for table, text in dumped.items())


async def test_values_after_soft_hyphenated_words_are_all_masked(database: Path) -> None:
    # Text pasted from a web page keeps its soft hyphens: ten of them before the address put
    # its original span where the phone number lies in the text the detectors read.
    pasted = (
        "Ac\u00adcom\u00admo\u00adda\u00adtion re\u00adser\u00adva\u00adtion "
        "con\u00adfir\u00adma\u00adtion: mallory.z3k@example.org, call +1 415 555 0132"
    )
    agent = Agent.open(
        f"sqlite:///{database}",
        system_prompt="You confirm bookings.",
        model=ScriptedModel(lambda call: "Noted."),
        memory=False,
    )
    try:
        reply = await agent.run(pasted, session="s1", user="u1")
    finally:
        await agent.aclose()
    assert reply.status == "completed", reply
    stored = "\n".join(dump_sqlite(database).values())
    assert "<EMAIL_1>" in stored
    assert "415 555 0132" not in stored, "the phone number reached the database raw"


async def test_a_streamed_value_padded_with_invisible_characters_is_held_back_whole(
    database: Path,
) -> None:
    # Four zero-width spaces after each character make the IBAN 91 characters long: held back
    # by 64 characters counted with them, its first group was streamed raw, and the rest of
    # the reply never came (it no longer followed what was shown).
    gap = "\u200b" * 4
    padded = " ".join(gap.join(group) for group in ["GB82", "WEST", "1234", "5698", "7654", "32"])
    answer = f"Wire it to {padded} today, and that is all for now; see you next week."
    with SQLiteDatabase(database) as sqlite:
        agent = sqlite_agent(sqlite, ScriptedModel(lambda call: answer))  # streams masked
        events = [event async for event in agent.stream("Where to?", session="s1", user="u1")]
    reply = events[-1].reply  # type: ignore[union-attr]
    streamed = "".join(event.text for event in events if isinstance(event, TextDelta))
    assert "GB82" not in streamed.replace("\u200b", ""), streamed
    assert streamed == reply.text and reply.text.endswith("see you next week."), streamed
