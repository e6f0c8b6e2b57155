"""A lone surrogate (half a character: a Python string or a JSON escape can hold one) and the
replacement character U+FFFD that keel stores in its place are not part of any value: a card,
a phone number or an address with one inside is masked whole, through the masker and through
an Agent's turn (the user's text, a tool's result, the model's reply) down to every table."""

from __future__ import annotations

import json

import pytest

from keel.messages import Message
from keel.privacy import PIIMasker
from keel.runtime import Agent
from keel.settings import load_settings
from keel.testing import ScriptedCall, ScriptedModel
from keel.tools import tool
from tests.privacy._samples import dump_sqlite

BROKEN = ["\ud800", "\udfff", "\ufffd"]


@pytest.mark.parametrize("char", BROKEN)
def test_a_value_with_a_broken_character_inside_is_masked_whole(char: str) -> None:
    text = f"card 4111 1111{char} 1111 1111, mail bob{char}@example.com, "
    text += f"call +1 415 555{char} 0132."
    assert PIIMasker().mask_text(text) == "card <CREDIT_CARD_1>, mail <EMAIL_1>, call <PHONE_1>."


def test_the_broken_character_escaped_in_json_is_masked_with_the_value() -> None:
    written = json.dumps({"card": "4111\ud8001111 1111 1111", "note": "ok \ufffd"})
    assert "\\ud800" in written and "\\ufffd" in written
    masked = PIIMasker().mask_text(written)
    assert json.loads(masked) == {"card": "<CREDIT_CARD_1>", "note": "ok \ufffd"}


CARD = "4111 1111\ud800 1111 1111"


@tool
def lookup(reference: str) -> str:
    """Look up a customer."""
    return f"customer {reference}: card on file {CARD}"


def _policy(call: ScriptedCall) -> Message | str:
    if not any(m.role == "tool" for m in call.messages):
        return ScriptedModel.tool_call("lookup", json.dumps({"reference": "c-7"}))
    return f"Your card {CARD} is on file."


@pytest.mark.parametrize("vault", ["on", "off"])
async def test_no_table_holds_the_digits_of_a_card_with_a_broken_character(
    vault: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KEEL_PII_VAULT", vault)
    agent = Agent.embedded(ScriptedModel(_policy), system_prompt="s", tools=[lookup], memory=True)
    try:
        reply = await agent.handle("s1", "u1", f"is my card {CARD} on file?")
    finally:
        await agent.aclose()
    assert reply.status == "completed"
    path = load_settings().sqlite_path
    assert path is not None
    dumped = dump_sqlite(path)
    assert dumped.get("keel_state_checkpoints") and dumped.get("trace_steps")
    found = [table for table, text in dumped.items() if "1111 1111" in text or "4111" in text]
    assert found == []
