"""A tool's output written with ``json.dumps(..., ensure_ascii=True)`` carries its values in
JSON's escapes (``j\\u00f6rg.m\\u00fcller@b\\u00fccher.example``, a phone number's no-break
spaces as ``\\u00a0``, a card in fullwidth digits as ``\\uff14...``, a token after an escaped
line break), and so does a user's pasted JSON: none of them reaches the database, in any of
its forms: not the session's messages, the tool journal, the traces nor the memory. The model
is shown the output masked and still JSON."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from keel.messages import Message, ToolCall
from keel.privacy._detectors import fold
from keel.runtime import Agent
from keel.testing import ScriptedCall, ScriptedModel
from keel.tools import tool
from tests.privacy._samples import dump_sqlite, leaks

TOKEN = "Zx9Cv8Bn7Mq6Wr5Ty4Ui3Op2"
VALUES = {
    "EMAIL": "jörg.müller@bücher.example",
    "PHONE": "+1\u00a0415\u00a0555\u00a00132",
    "CREDIT_CARD": "４１１１ １１１１ １１１１ １１１１",
    "BEARER_TOKEN": TOKEN,
}
CUSTOMER = {
    "name": "Jörg",
    "email": VALUES["EMAIL"],
    "phone": VALUES["PHONE"],
    "card": VALUES["CREDIT_CARD"],
    "auth": f"Bearer\n{TOKEN}",
}
# The user pastes theirs as JSON too (escaped): the memory keeps what they said.
USER_VALUES = {
    "EMAIL": "zoë.núñez@correo.example",
    "PHONE": "+34\u00a0612\u00a0345\u00a0678",
}
shown: list[str] = []


@tool(side_effect=True, idempotent=False)
def open_ticket(customer_id: str) -> str:
    """Open a support ticket for a customer (journalled: it has an effect).

    Args:
        customer_id: The customer's id.
    """
    return json.dumps(CUSTOMER)  # ensure_ascii=True: every non-ASCII character escaped


def _reply(call: ScriptedCall) -> Message | str:
    results = [m for m in call.messages if m.role == "tool"]
    if results:
        shown.extend(str(m.content) for m in results)
        return "The ticket is open."
    arguments = json.dumps({"customer_id": "c-17"})
    return Message.assistant(
        "", tool_calls=[ToolCall(id="c1", name="open_ticket", arguments=arguments)]
    )


def _forms(value: str) -> set[str]:
    """The value as written, as JSON's ASCII escapes write it, and as it reads (folded: ASCII
    digits and spaces), with and without its spaces: each is the same leak."""
    escaped = json.dumps(value)[1:-1]
    folded = fold(value)
    return {value, escaped, folded, folded.replace(" ", ""), escaped.replace("\\u00a0", "")}


@pytest.fixture
def database(tmp_path: Path) -> Iterator[Path]:
    shown.clear()
    yield tmp_path / "keel.db"


async def test_values_a_tool_wrote_in_json_escapes_never_reach_the_database(
    database: Path,
) -> None:
    agent = Agent.open(
        f"sqlite:///{database}",
        system_prompt="You open tickets.",
        model=ScriptedModel(_reply),
        tools=[open_ticket],
        memory=True,
    )
    try:
        pasted = json.dumps({"email": USER_VALUES["EMAIL"], "phone": USER_VALUES["PHONE"]})
        said = f"Open a ticket for customer c-17, and note mine: {pasted}"
        reply = await agent.run(said, session="s1", user="u1")
    finally:
        await agent.aclose()
    assert reply.status == "completed", reply
    # The model was shown the output masked, every value whole, and still JSON.
    [output] = shown
    masked = json.loads(output)
    assert masked.keys() == CUSTOMER.keys() and masked["name"] == "Jörg"
    assert re.fullmatch(r"<EMAIL_\d>", masked["email"]), masked
    assert re.fullmatch(r"<PHONE_\d>", masked["phone"]), masked
    assert re.fullmatch(r"<CREDIT_CARD_\d>", masked["card"]), masked
    assert re.fullmatch(r"Bearer\n<BEARER_TOKEN_\d>", masked["auth"]), masked
    dumped = dump_sqlite(database)
    assert "open_ticket" in dumped["keel_tool_journal"]
    assert any(table.startswith("trace") for table in dumped)
    leaked = leaks(dumped, VALUES, USER_VALUES, forms=_forms)
    assert leaked == []
    # What was looked in holds the values masked: the output in the journal, the user's
    # message in the memory.
    assert "<CREDIT_CARD_" in dumped["keel_tool_journal"]
    assert any("memor" in table and "<EMAIL_" in text for table, text in dumped.items())
