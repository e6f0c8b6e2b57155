"""The Agent with long-term memory: turns and summaries reach memory, memories reach prompts."""

from __future__ import annotations

from keel.context import ContextBudget
from keel.memory import HashingEmbedder, Memory, Scope
from keel.messages import Message
from keel.runtime import Agent
from keel.state import AgentState, StateStore
from keel.stores import SQLiteDatabase, SQLiteMemoryStore, SQLStateBackend
from keel.testing import ScriptedCall, ScriptedModel


async def test_turns_summaries_and_recall_flow_through_memory(database: SQLiteDatabase) -> None:
    memory = Memory(SQLiteMemoryStore(database), embedder=HashingEmbedder(dimension=64))

    def policy(call: ScriptedCall) -> Message | str:
        return "Noted. " + "detail " * 60

    model = ScriptedModel(policy)
    agent = Agent(
        model,
        state=StateStore(SQLStateBackend(database), AgentState),
        system_prompt="You are a concierge.",
        memory=memory,
        context=ContextBudget(working_budget=3_000),
    )
    await agent.handle("s1", "ada", "My email is ada@example.com and I am allergic to peanuts.")
    for turn in range(30):
        await agent.handle("s1", "ada", f"filler message {turn} " + "words " * 40)
    memory.flush()
    scope = Scope(tenant_id="default", user_id="ada")
    records = memory.recent(scope, limit=200)
    kinds = {record.type for record in records}
    assert "turn" in kinds and "summary" in kinds
    # One summary per session, the running one: each new summary replaced the one before (it
    # restated most of it), so memory holds no chain of near-copies.
    summaries = [record for record in records if record.type == "summary"]
    state_now = agent.session_state("s1")
    assert state_now is not None and len(summaries) == 1
    assert summaries[0].text == state_now.runtime.summary and summaries[0].session_id == "s1"
    # PII was masked before anything was stored: memory, checkpoints.
    assert all("ada@example.com" not in record.text for record in records)
    state = agent.session_state("s1")
    assert state is not None
    assert all("ada@example.com" not in m.content for m in state.messages)
    # A new session for the same user recalls the allergy from long-term memory.
    await agent.handle("s2", "ada", "Remind me: what am I allergic to?")
    prompt = model.calls[-1].messages
    assert any("peanuts" in m.content for m in prompt if m.role == "system")
    # Another user's memory stays out of ada's prompts, and ada's out of theirs.
    await agent.handle("s3", "bob", "Remind me: what am I allergic to?")
    assert not any("peanuts" in m.content for m in model.calls[-1].messages)
    memory.close()
