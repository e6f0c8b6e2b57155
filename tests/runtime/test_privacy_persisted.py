"""Nothing unmasked reaches the database through Agent (design invariant 7).

Turns whose user text, tool output and model output (final text, the text beside a tool call,
the call's arguments) each carry every PII kind: one completes, one stops on its step limit,
one stops because a tool keeps failing with PII in its error. Then every column of every table
of the embedded SQLite file (checkpoint history, tool journal and decisions, traces, memory and
its indexes, whatever tables exist by then) is searched for the raw values.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest

from keel.guards import GuardConfig
from keel.messages import Message
from keel.runtime import Agent, AgentReply
from keel.settings import load_settings
from keel.testing import ScriptedCall, ScriptedModel
from keel.tools import tool
from tests.privacy._samples import MODEL_PII, TOOL_PII, USER_PII, dump_sqlite, leaks, sentence

ALL = (USER_PII, TOOL_PII, MODEL_PII)


@tool(side_effect=True, idempotent=False)
def file_claim(customer: str, note: str) -> str:
    """File an insurance claim."""
    return f"claim filed for {customer}; the insurer answers at {sentence(TOOL_PII)}"


@tool
def lookup_policy(reference: str) -> str:
    """Look up a policy."""
    return f"policy {reference}: holder {sentence(TOOL_PII)}"


@tool(side_effect=True)
def charge_card(card: str) -> str:
    """Charge a card; the processor always refuses, quoting the customer's details."""
    raise ValueError(f"card {card} declined for {sentence(TOOL_PII)}")


def _call(name: str, arguments: dict[str, str], text: str = "") -> Message:
    message = ScriptedModel.tool_call(name, json.dumps(arguments))
    return message.model_copy(update={"content": text})


def policy(call: ScriptedCall) -> Message | str:
    """The model's own output carries PII too (it might have invented or recalled it)."""
    asked = call.last_user_text
    answered = [m for m in call.messages if m.role == "tool"]
    if "[claim]" in asked:
        if not any(m.name == "file_claim" for m in answered):
            return _call(
                "file_claim",
                {"customer": MODEL_PII["EMAIL"], "note": sentence(MODEL_PII)},
                text=f"Filing it. {sentence(MODEL_PII)}",
            )
        return f"Your claim is filed. {sentence(MODEL_PII)}"
    if "[loop]" in asked:
        # A new reference every step: no loop, only the step limit stops it.
        reference = f"{MODEL_PII['IBAN']} #{len(call.messages)}"
        return _call("lookup_policy", {"reference": reference}, text=sentence(MODEL_PII))
    if "[charge]" in asked:
        return _call(
            "charge_card",
            {"card": f"{MODEL_PII['CREDIT_CARD']} #{len(call.messages)}"},
            text=f"Charging {sentence(MODEL_PII)}",
        )
    return f"Hello. {sentence(MODEL_PII)}"


@pytest.fixture(params=["vault", "masking-only"])
async def agent(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Agent]:
    """The embedded default (its own PII key, a vault), and an agent that opts out of it."""
    if request.param == "masking-only":
        monkeypatch.setenv("KEEL_PII_VAULT", "off")
    built = Agent.embedded(
        ScriptedModel(policy),
        system_prompt="You file insurance claims.",
        tools=[file_claim, lookup_policy, charge_card],
        memory=True,
        guards=GuardConfig(max_steps=3, max_tool_retries=1),
    )
    yield built
    await built.aclose()


async def _turns(agent: Agent) -> list[AgentReply]:
    replies = []
    for marker in ("[claim]", "[loop]", "[charge]", "[chat]"):
        replies.append(await agent.handle("s1", "u1", f"{marker} {sentence(USER_PII)}"))
    return replies


async def test_no_table_holds_a_raw_value_after_completed_and_failed_turns(agent: Agent) -> None:
    replies = await _turns(agent)
    assert [r.status for r in replies] == [
        "completed",
        "step_limit",
        "tool_retry_limit",
        "completed",
    ]
    assert replies[0].tool_calls == ("file_claim",)
    await agent.aclose()  # flush memory's outbox, release the file
    path = load_settings().sqlite_path
    assert path is not None and path.exists()
    dumped = dump_sqlite(path)
    # The tables the turns must have written, so an empty dump cannot pass.
    for table in (
        "keel_state_checkpoints",
        "keel_tool_journal",
        "keel_tool_decisions",
        "trace_runs",
        "trace_steps",
        "memory_records",
    ):
        assert dumped.get(table), f"{table} is empty"
    assert leaks(dumped, *ALL) == []
    # Nor the file's bytes: no raw value was ever written, even to a page freed since.
    files = [path, *(path.with_name(path.name + suffix) for suffix in ("-wal", "-journal"))]
    raw = b"".join(file.read_bytes() for file in files if file.exists())
    assert leaks({"file": raw.decode("latin-1")}, *ALL) == []


async def test_a_failed_turn_reports_no_raw_value(agent: Agent) -> None:
    replies = await _turns(agent)
    for reply in replies[1:3]:
        assert reply.status != "completed"
        if agent.vault is not None:
            # The reply is its user's to read: their own values are shown, the error too.
            continue
        assert leaks({"text": reply.text, "error": reply.error or ""}, *ALL) == []
