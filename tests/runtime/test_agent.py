"""The Agent end to end on the embedded default, with the scripted policy as the model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from keel.context import ContextBudget
from keel.demo import Airline, FlightUser, demo_machine, flight_tools, plans, policy_model
from keel.errors import ContextLengthExceededError, ModelUnavailableError
from keel.guards import GuardConfig
from keel.messages import Message
from keel.runtime import Agent
from keel.state import AgentState, StateStore
from keel.stores import SQLiteDatabase, SQLStateBackend, SQLToolJournal
from keel.stores._sql_traces import SQLTraceStore
from keel.testing import ScriptedCall, ScriptedModel
from keel.tracing import RunQuery, Tracer


def _agent(
    database: SQLiteDatabase,
    tmp_path: Path,
    model: ScriptedModel,
    *,
    guards: GuardConfig | None = None,
    budget: int = 8_000,
) -> tuple[Agent, Airline, SQLTraceStore]:
    traces = SQLTraceStore(database)
    traces.setup()
    airline = Airline(tmp_path / "airline.db")
    agent = Agent(
        model,
        state=StateStore(SQLStateBackend(database), AgentState),
        system_prompt="You are SkyDesk.",
        tools=flight_tools(airline),
        machine=demo_machine(),
        journal=SQLToolJournal(database),
        tracer=Tracer(traces),
        context=ContextBudget(working_budget=budget),
        guards=guards,
    )
    return agent, airline, traces


async def _converse(agent: Agent, user: FlightUser, limit: int = 200) -> list[str]:
    replies: list[str] = []
    reply = ""
    while (message := user.next_message(reply)) is not None and len(replies) < limit:
        result = await agent.handle("s1", "u1", message)
        reply = result.text
        replies.append(reply)
        assert result.max_prompt_tokens <= agent.prompt_limit
    return replies


async def test_books_each_trip_once_and_checkpoints_before_every_model_call(
    database: SQLiteDatabase, tmp_path: Path
) -> None:
    model = ScriptedModel(policy_model)
    agent, airline, traces = _agent(database, tmp_path, model)
    replies = await _converse(agent, FlightUser(plans(2, 2)))
    assert sum("Your booking reference is" in r for r in replies) == 2
    assert sorted(airline.bookings_per_trip().values()) == [1, 1]
    history = agent.state.history(agent.session_key("s1"))
    before_calls = [c for c in history if c.reason == "before model call"]
    assert len(before_calls) == len(model.calls)
    assert any(c.reason == "after transition" for c in history)
    state = agent.session_state("s1")
    assert state is not None and state.runtime.turns == len(replies)
    # Every prompt: the system prompt first, the workflow rules right before the user message.
    for call in model.calls:
        assert call.messages[0].content == "You are SkyDesk."
        last_user = max(i for i, m in enumerate(call.messages) if m.role == "user")
        assert "Current step:" in call.messages[last_user - 1].content
    runs = traces.list_runs(RunQuery(session_id="s1"))
    assert len(runs) == len(replies)


async def test_persistent_model_failure_reverts_and_counts_retries(
    database: SQLiteDatabase, tmp_path: Path
) -> None:
    def flaky(call: ScriptedCall) -> Message | str:
        if "From" in call.last_user_text:
            raise ModelUnavailableError("provider down", model="scripted")
        return policy_model(call)

    agent, _, _ = _agent(database, tmp_path, ScriptedModel(flaky))
    first = await agent.handle("s1", "u1", "Hi! I'd like to book a flight.")
    assert first.workflow_state == "gathering_origin"
    good_version = first.state_version
    failed = await agent.handle("s1", "u1", "From Lisbon.")
    assert failed.status != "completed"
    assert failed.reverted
    assert "try again" in failed.text.lower()
    state = agent.session_state("s1")
    assert state is not None and state.machine is not None
    assert state.machine.state == "gathering_origin"
    assert "origin" not in state.machine.slots
    assert state.machine.retries.get("gathering_origin") == 1
    # Nothing of the failed turn's tool calls survives; the exchange itself is kept.
    assert all(not m.tool_calls for m in state.messages[-2:])
    assert failed.state_version > good_version


async def test_step_limit_ends_cleanly(database: SQLiteDatabase, tmp_path: Path) -> None:
    always_tools = ScriptedModel(
        lambda call: ScriptedModel.tool_call(
            "remember", json.dumps({"slot": "note", "value": str(len(call.messages))})
        )
    )
    agent, _, _ = _agent(database, tmp_path, always_tools, guards=GuardConfig(max_steps=4))
    reply = await agent.handle("s1", "u1", "Hi! I'd like to book a flight.")
    assert reply.status == "step_limit"
    assert reply.steps <= 4
    assert reply.reverted
    state = agent.session_state("s1")
    assert state is not None and state.machine is not None
    assert "note" not in state.machine.slots


async def test_context_length_error_shrinks_the_prompt_and_retries(
    database: SQLiteDatabase, tmp_path: Path
) -> None:
    sizes: list[int] = []
    reject = {"next": False}

    def picky(call: ScriptedCall) -> Message | str:
        sizes.append(agent.model.counter.count_prompt(call.messages, call.tools))
        if reject["next"]:
            reject["next"] = False
            raise ContextLengthExceededError("maximum context length exceeded", model="x")
        return "Noted. " + "details " * 80

    agent, _, _ = _agent(database, tmp_path, ScriptedModel(picky), budget=4_000)
    for turn in range(25):
        await agent.handle("s1", "u1", f"turn {turn}: " + "words " * 80)
    reject["next"] = True
    sizes.clear()
    reply = await agent.handle("s1", "u1", "one more")
    assert reply.status == "completed"
    assert len(sizes) == 2
    assert sizes[1] < sizes[0], "the retry sent a smaller prompt"


async def test_long_session_prompt_never_exceeds_the_limit(
    database: SQLiteDatabase, tmp_path: Path
) -> None:
    model = ScriptedModel(policy_model)
    agent, airline, _ = _agent(database, tmp_path, model, budget=4_000)
    replies = await _converse(agent, FlightUser(plans(6, 6)), limit=400)
    assert len(replies) > 60
    assert len(airline.bookings_per_trip()) == 6
    state = agent.session_state("s1")
    assert state is not None
    assert state.runtime.summary, "old turns were folded into the summary"
    assert all(
        agent.model.counter.count_prompt(call.messages, call.tools) <= agent.prompt_limit
        for call in model.calls
    )


@pytest.mark.slow
async def test_a_thousand_turns_stay_under_the_window_minus_reserve(
    database: SQLiteDatabase, tmp_path: Path
) -> None:
    """The seed's 1000-turn practice: every prompt, at every turn, fits the limit."""
    from keel.tools import tool

    @tool
    def lookup(topic: str) -> str:
        """Look a topic up (long output).

        Args:
            topic: What to look up.
        """
        return f"{topic}: " + "lorem ipsum dolor sit amet " * (200 + len(topic) * 40)

    def policy(call: ScriptedCall) -> Message | str:
        last = call.messages[-1]
        if last.role == "user" and "look up" in last.content:
            return ScriptedModel.tool_call("lookup", json.dumps({"topic": last.content[-12:]}))
        return f"Noted ({len(call.messages)} messages in view)."

    model = ScriptedModel(policy, model="gpt-4o-mini")
    agent = Agent(
        model,
        state=StateStore(SQLStateBackend(database), AgentState),
        system_prompt="You are a research assistant.",
        tools=[lookup],
        context=ContextBudget(working_budget=6_000),
    )
    limit = agent.prompt_limit
    worst = 0
    for turn in range(1000):
        text = f"please look up item {turn:04d}" if turn % 4 == 0 else f"note {turn}: " + "x " * 40
        reply = await agent.handle("long", "u1", text)
        assert reply.status == "completed"
        worst = max(worst, reply.max_prompt_tokens)
    assert worst <= limit
    assert all(
        model.counter.count_prompt(call.messages, call.tools) <= limit for call in model.calls
    )
    state = agent.session_state("long")
    assert state is not None and state.runtime.turns == 1000
    assert state.runtime.summary


async def test_one_log_is_what_the_store_keeps_and_the_context_engine_reads(
    database: SQLiteDatabase, tmp_path: Path
) -> None:
    # A small window: turns are summarized away on the way, and the log must follow.
    model = ScriptedModel(policy_model)
    agent, _, _ = _agent(database, tmp_path, model, budget=3_000)
    await _converse(agent, FlightUser(plans(2, 2)))
    key = agent.session_key("s1")
    log = agent._logs[key]
    stored = agent.state.load(key)
    assert log.version == stored.version
    assert log.messages == stored.state.messages
    summarized = stored.state.runtime.messages_summarized
    assert summarized > 0, "nothing was summarized: the test does not reach eviction"
    assert log.messages_summarized == summarized
    # The context engine's conversation holds the log's messages past the summary, the same
    # objects the checkpoint stored.
    assert log.conversation.messages == log.messages[summarized:]
    # Kept in step, not rebuilt from the store each turn (that would cost the whole history).
    await agent.handle("s1", "u1", "Thanks, that is all.")
    assert agent._logs[key] is log
    assert log.messages == agent.state.load(key).state.messages
