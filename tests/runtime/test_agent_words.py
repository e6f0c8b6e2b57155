"""Whose words are whose: the user's claims, the model's answers and keel's own words (its
apologies and notes) are kept apart in the history, the prompt and long-term memory."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from keel.context import ContextBudget, is_runtime_note
from keel.demo._junk import PromptRecorder, StoredMemory, audit_memories, read_prompted
from keel.errors import ModelError
from keel.memory import MemoryFilter, MemoryRecord, Scope
from keel.runtime import Agent
from keel.settings import load_settings
from keel.testing import ScriptedModel, ScriptedReply

USER = "ada"


@pytest.fixture
def recorder(tmp_path: Path) -> Iterator[PromptRecorder]:
    """What the demo's memory audit reads: every text given to the prompt compiler."""
    prompted = PromptRecorder(tmp_path / "prompted.jsonl")
    yield prompted
    prompted.close()


def _embedded(
    tmp_path: Path, model: ScriptedModel, recorder: PromptRecorder, **options: Any
) -> Agent:
    agent = Agent.embedded(
        model,
        system_prompt="You are a concierge. Answer briefly.",
        settings=load_settings(data_dir=tmp_path / "data", embedder="hashing:64"),
        **options,
    )
    recorder.install(agent)
    return agent


def _stored(agent: Agent) -> list[MemoryRecord]:
    """Every record in the agent's memory, oldest first (as the demo's audit lists them)."""
    assert agent.memory is not None
    agent.memory.flush()
    everything = MemoryFilter(include_superseded=True, include_expired=True)
    return agent.memory.store.list_records(
        Scope(tenant_id=agent.tenant_id, user_id=USER),
        everything,
        limit=agent.memory.store.count() + 1,
        newest_first=False,
    )


def _audit_is_clean(records: list[MemoryRecord], recorder: PromptRecorder) -> None:
    audit = audit_memories(
        [StoredMemory(id=r.id, kind=r.kind, type=r.type, text=r.text) for r in records],
        read_prompted(recorder.path),
    )
    assert audit.junk == 0, audit.examples


# --- the model's words are never the user's claim ---------------------------------------------


async def test_what_the_model_says_is_stored_as_the_assistants_not_as_the_users_claim(
    tmp_path: Path, recorder: PromptRecorder
) -> None:
    model = ScriptedModel(["Noted: you live in Bergen, by the fish market.", "Sure."])
    async with _embedded(tmp_path, model, recorder) as agent:
        first = await agent.run("Hello?", session="s1", user=USER)
        second = await agent.run("I live in Oslo.", session="s1", user=USER)
        assert (first.status, second.status) == ("completed", "completed")
        records = _stored(agent)
    _audit_is_clean(records, recorder)
    claims = [r for r in records if r.provenance == "user_claim"]
    # Only what the user wrote is the user's claim, one record per message.
    assert sorted(r.text for r in claims) == ["User: Hello?", "User: I live in Oslo."]
    assert all(r.metadata.get("speaker") == "user" for r in claims)
    invented = [r for r in records if "by the fish market" in r.text]
    assert [(r.text, r.provenance) for r in invented] == [
        ("Assistant: Noted: you live in Bergen, by the fish market.", "inferred")
    ]
    assert invented[0].metadata.get("speaker") == "assistant"
    # Both sides of a turn stay one turn of the session (the neighbours retrieval shows).
    hello = next(r for r in claims if r.text == "User: Hello?")
    assert (hello.session_id, hello.turn) == (invented[0].session_id, invented[0].turn) == ("s1", 1)


# --- keel's own words are never the model's, and never in memory --------------------------------

APOLOGIES = {
    "model_failed": "having trouble producing an answer",
    "failed": "something went wrong on my side",
}


class _Itinerary(BaseModel):
    """An answer type whose schema is too long for the operating rules' cap below."""

    origin: str
    destination: str
    departure_date: str
    return_date: str
    passengers: int
    cabin_class: str


@pytest.mark.parametrize("failure", ["model_failed", "failed"])
async def test_a_failed_turns_apology_is_shown_and_traced_but_never_the_models_own_words(
    tmp_path: Path, recorder: PromptRecorder, failure: str
) -> None:
    apology = APOLOGIES[failure]
    if failure == "model_failed":
        # The model kept failing: the loop's fallback.
        replies: list[ScriptedReply] = [ModelError("overloaded"), ModelError("overloaded")]
        output_type: type[Any] | None = None
    else:
        # The prompt cannot be built (the answer type's rule is over its cap): the agent's own.
        replies, output_type = [], _Itinerary
    model = ScriptedModel([*replies, "Once upon a time."])
    context = ContextBudget(rules_cap=40)
    async with _embedded(tmp_path, model, recorder, context=context) as agent:
        failed = await agent.run(
            "Tell me a story", session="s1", user=USER, output_type=output_type
        )
        # The user is told, and the trace records what the user was told.
        assert failed.status == failure and apology in failed.text and failed.error
        assert agent.backends is not None
        run = agent.backends.traces.get_run(failed.run_id)
        assert run is not None and run.output is not None and apology in run.output
        answered = await agent.run("Tell me a story, please", session="s1", user=USER)
        assert answered.status == "completed"
        state = agent.session_state("s1")
        records = _stored(agent)
    prompt = model.calls[-1].messages
    # The next prompt holds no apology as something the assistant said; what it holds of the
    # failed turn is keel's note, a system message that says it is keel's.
    assert not any(apology in m.content for m in prompt)
    assert [m.role for m in prompt if m.role != "system"] == ["user", "user"]
    notes = [m for m in prompt if "keel runtime note" in m.content]
    assert [(m.role, is_runtime_note(m)) for m in notes] == [("system", True)]
    assert f"({failure})" in notes[0].content
    assert state is not None
    assert not any(m.role == "assistant" and apology in m.content for m in state.messages)
    # Memory holds the user's words and the model's answer, nothing of keel's.
    _audit_is_clean(records, recorder)
    assert not any(apology in r.text or "keel runtime note" in r.text for r in records)
    assert sorted(r.text for r in records) == [
        "Assistant: Once upon a time.",
        "User: Tell me a story, please",
    ]
