"""ToolLoop(redact=...): the journalled decisions and results are masked; resume replays them."""

from __future__ import annotations

import json

import pytest

from keel.messages import Message
from keel.privacy import mask_pii
from keel.runtime import ToolLoop
from keel.stores import SQLiteDatabase, SQLToolJournal
from keel.testing import ScriptedModel
from keel.tools import ToolRegistry, tool
from tests.privacy._samples import MODEL_PII, TOOL_PII, USER_PII, dump_sqlite, leaks, sentence

filed: list[str] = []
FILED = f"claim filed; the insurer answers at {sentence(TOOL_PII)}"


@tool(side_effect=True, idempotent=False)
def file_claim(customer: str, note: str) -> str:
    """File a claim (an effect: it runs once)."""
    filed.append(customer)
    return FILED


REGISTRY = ToolRegistry([file_claim])
USER = [Message.system("You file claims."), Message.user("File a claim for me.")]


class Crash(BaseException):
    """The process dies (not an error the loop handles)."""


@pytest.fixture(autouse=True)
def _clear() -> None:
    filed.clear()


def _decision() -> Message:
    # The model's own output carries PII: in its text and in the call's arguments.
    arguments = {"customer": MODEL_PII["EMAIL"], "note": sentence(MODEL_PII)}
    decision = ScriptedModel.tool_call("file_claim", json.dumps(arguments), call_id="call_a")
    return decision.model_copy(update={"content": f"Filing now. {sentence(MODEL_PII)}"})


async def test_decisions_and_results_are_journalled_masked(database: SQLiteDatabase) -> None:
    journal = SQLToolJournal(database)
    model = ScriptedModel([_decision(), "Done."])
    loop = ToolLoop(model, REGISTRY, journal=journal, redact=mask_pii)
    result = await loop.arun(USER, session_id="s1")
    assert result.ok
    # The call is carried out as the model made it; the run's messages are the caller's.
    assert filed == [MODEL_PII["EMAIL"]]
    assert result.messages[2].tool_calls == _decision().tool_calls
    decision = journal.decision("s1", 0)
    assert decision is not None and decision.tool_calls[0].id == "call_a"
    assert json.loads(decision.tool_calls[0].arguments)["customer"] == "<EMAIL_1>"
    assert "<IBAN_1>" in decision.content
    assert leaks({"decision": decision.model_dump_json()}, MODEL_PII) == []
    entries = "\n".join(e.model_dump_json() for e in journal.entries("s1"))
    assert leaks({"entries": entries}, MODEL_PII, TOOL_PII) == []
    database.close()
    assert leaks(dump_sqlite(database.path), MODEL_PII, TOOL_PII, USER_PII) == []


async def test_resume_replays_the_masked_decision_and_result_exactly_once(
    database: SQLiteDatabase,
) -> None:
    journal = SQLToolJournal(database)

    def died(_: object) -> Message:
        raise Crash("killed after the tool ran, before the next model call")

    crashing = ScriptedModel([_decision(), died])
    with pytest.raises(Crash):
        await ToolLoop(crashing, REGISTRY, journal=journal, redact=mask_pii).arun(
            USER, session_id="s1"
        )
    assert filed == [MODEL_PII["EMAIL"]]
    # A fresh process resumes at the interrupted step: the journal has the decision and the
    # result, both masked; the tool does not run again and the model is not asked again.
    fresh = ScriptedModel(["Done."])
    result = await ToolLoop(fresh, REGISTRY, journal=journal, redact=mask_pii).arun(
        USER, session_id="s1"
    )
    assert result.ok and filed == [MODEL_PII["EMAIL"]] and len(fresh.calls) == 1
    step = result.steps[0]
    assert step.replayed_decision and step.tool_results[0].replayed
    assert step.tool_results[0].content == mask_pii(FILED)
    replayed = "".join(m.model_dump_json() for m in result.messages[2:4])
    assert leaks({"replayed": replayed}, MODEL_PII, TOOL_PII) == []


async def test_another_runs_decision_is_the_one_carried_out(database: SQLiteDatabase) -> None:
    journal = SQLToolJournal(database)
    theirs = ScriptedModel.tool_call(
        "file_claim", json.dumps({"customer": "<EMAIL_1>", "note": "theirs"}), call_id="call_t"
    )
    model = ScriptedModel([_decision(), "Done."])
    loop = ToolLoop(model, REGISTRY, journal=journal, redact=mask_pii)

    original = journal.arecord_decision

    async def first_writer_wins(session_id: str, step: int, message: Message) -> Message:
        await original(session_id, step, theirs)  # another run wrote its decision just before
        return await original(session_id, step, message)

    # The loop records its decision through the journal's async twin (native on every store).
    journal.arecord_decision = first_writer_wins  # type: ignore[method-assign]
    result = await loop.arun(USER, session_id="s1")
    assert result.ok and filed == ["<EMAIL_1>"]
    assert result.messages[2].tool_calls[0].id == "call_t"
