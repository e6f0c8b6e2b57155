"""A JSON text held in a JSON string whose values need no ``\\uXXXX`` (ASCII only) carries
only short escapes escaped again: ``card\\\\n4111 1111 1111 1111``, ``key\\\\tsk-...``,
``\\\\"bob@example.com\\\\"``. Read once, the line break before a card is a backslash and an
"n" glued to its digits, which no detector takes for the start of a value; the text is read
decoded twice as well, and none of them reaches the database. The model is shown the output
masked and still JSON at both levels."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from keel.messages import Message, ToolCall
from keel.runtime import Agent
from keel.testing import ScriptedCall, ScriptedModel
from keel.tools import tool
from tests.privacy._samples import TOOL_PII, dump_sqlite, leaks

TOKEN = "Q7wErTy8uIoP9aSdFgHj0kLz"
VALUES = {**TOOL_PII, "BEARER_TOKEN": TOKEN}
NOTE = (
    f"card\n{TOOL_PII['CREDIT_CARD']}\nkey\t{TOOL_PII['API_KEY']}\n"
    f'mail\n"{TOOL_PII["EMAIL"]}"\nIBAN\n{TOOL_PII["IBAN"]}\ncall\n{TOOL_PII["PHONE"]}\n'
    f"SSN\n{TOOL_PII['US_SSN']}\nauth: Bearer\n{TOKEN}"
)
shown: list[str] = []


@tool(side_effect=True, idempotent=False)
def fetch_note(note_id: str) -> str:
    """Fetch a note, as an upstream service wraps it: a JSON text in a JSON string.

    Args:
        note_id: The note's id.
    """
    return json.dumps({"content": json.dumps({"id": note_id, "note": NOTE})})


def _reply(call: ScriptedCall) -> Message | str:
    results = [m for m in call.messages if m.role == "tool"]
    if results:
        shown.extend(str(m.content) for m in results)
        return "Noted."
    arguments = json.dumps({"note_id": "n-17"})
    return Message.assistant(
        "", tool_calls=[ToolCall(id="c1", name="fetch_note", arguments=arguments)]
    )


def _escaped_forms(value: str) -> set[str]:
    once = json.dumps(value)[1:-1]
    return {value, once, json.dumps(once)[1:-1]}


@pytest.fixture
def database(tmp_path: Path) -> Iterator[Path]:
    shown.clear()
    yield tmp_path / "keel.db"


async def test_values_behind_short_escapes_escaped_twice_never_reach_the_database(
    database: Path,
) -> None:
    assert "\\u" not in json.dumps({"content": json.dumps({"note": NOTE})})  # short ones only
    agent = Agent.open(
        f"sqlite:///{database}",
        system_prompt="You read notes.",
        model=ScriptedModel(_reply),
        tools=[fetch_note],
    )
    try:
        reply = await agent.run("Read note n-17.", session="s1", user="u1")
    finally:
        await agent.aclose()
    assert reply.status == "completed", reply
    dumped = dump_sqlite(database)
    assert "fetch_note" in dumped["keel_tool_journal"]
    # Raw, escaped once or twice, and the card's first group alone (read glued to an "n", it
    # was the part kept).
    assert leaks(dumped, VALUES, {"first group": "4111 "}, forms=_escaped_forms) == []
    assert "<CREDIT_CARD_" in dumped["keel_tool_journal"]
    [output] = shown
    inner = json.loads(output)["content"]
    assert "\\<" not in inner  # no placeholder after a backslash split from its "n"
    note = json.loads(inner)["note"]  # JSON at both levels
    assert re.fullmatch(
        r"card\n<CREDIT_CARD_1>\nkey\t<API_KEY_1>\nmail\n\"<EMAIL_1>\"\nIBAN\n<IBAN_1>\n"
        r"call\n<PHONE_1>\nSSN\n<US_SSN_1>\nauth: Bearer\n<BEARER_TOKEN_1>",
        note,
    ), note
