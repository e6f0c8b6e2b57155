"""The typed developer API through the real Agent on SQLite: answers of a declared type,
tools that get their context and the caller's dependencies, model options per agent and per
turn, and the agent as a context manager."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
from pydantic import BaseModel
from typing_extensions import TypedDict

from keel.errors import UsageError
from keel.messages import Message
from keel.models import ModelOptions
from keel.stores import SQLiteDatabase
from keel.testing import ScriptedCall, ScriptedModel
from keel.tools import Tool, ToolContext, tool
from tests.runtime.conftest import sqlite_agent


class Booking(BaseModel):
    flight: str
    seats: int
    contact: str


class Quote(TypedDict):
    price: float
    currency: str


async def test_an_output_type_answer_is_validated_corrected_and_returned(
    database: SQLiteDatabase,
) -> None:
    model = ScriptedModel(
        [
            '{"flight": "SK1", "seats": "two", "contact": "ann@example.com"}',
            '{"flight": "SK1", "seats": 2, "contact": "ann@example.com"}',
        ]
    )
    agent = sqlite_agent(database, model, output_type=Booking)
    reply = await agent.run("Book SK1 for two", session="s1", user="u1")
    assert reply.status == "completed"
    assert reply.output == Booking(flight="SK1", seats=2, contact="ann@example.com")
    # The model was told the schema, then exactly which field was wrong.
    assert any("JSON schema" in m.content for m in model.calls[0].messages)
    assert model.calls[0].options.json_schema == Booking.model_json_schema()
    correction = model.calls[1].messages[-1].content
    assert "Field 'seats'" in correction and "valid integer" in correction
    # What is stored and shown is masked; the value is the caller's only.
    assert "ann@example.com" not in reply.text and "<EMAIL_1>" in reply.text
    state = agent.session_state("s1")
    assert state is not None
    assert all("ann@example.com" not in m.content for m in state.messages)
    assert [m.role for m in state.messages] == ["user", "assistant"], "the retry was kept"


async def test_an_output_type_per_turn_and_a_bounded_retry(database: SQLiteDatabase) -> None:
    model = ScriptedModel(['{"price": 12.5, "currency": "EUR"}', "no idea"], repeat_last=True)
    agent = sqlite_agent(database, model)
    reply = await agent.run("Price?", session="s1", user="u1", output_type=Quote)
    assert reply.output == {"price": 12.5, "currency": "EUR"}
    plain = await agent.run("Thanks", session="s1", user="u1")
    assert plain.output is None and plain.text == "no idea"
    failed = await agent.run("Price again?", session="s1", user="u1", output_type=Quote)
    assert failed.status == "invalid_output" and failed.output is None
    assert len(model.calls) == 2 + 1 + agent.guards.max_output_retries


@dataclass
class Bank:
    balances: dict[str, int]


async def test_tools_get_their_context_and_the_callers_deps(database: SQLiteDatabase) -> None:
    seen: list[ToolContext[Bank]] = []

    @tool
    def balance(account: str, context: ToolContext[Bank]) -> str:
        """The balance of an account.

        Args:
            account: The account id.
        """
        seen.append(context)
        return str(context.deps.balances[account])

    def policy(call: ScriptedCall) -> Message | str:
        if call.messages[-1].role == "tool":
            return f"Balance: {call.messages[-1].content}"
        return ScriptedModel.tool_call("balance", json.dumps({"account": "A1"}))

    model = ScriptedModel(policy)
    agent = sqlite_agent(database, model, [balance], tenant_id="acme")
    reply = await agent.run("balance?", session="s1", user="u7", deps=Bank({"A1": 42}))
    assert reply.text == "Balance: 42"
    (context,) = seen
    assert (context.session_id, context.user_id, context.tenant_id) == (
        agent.session_key("s1"),
        "u7",
        "acme",
    )
    assert context.run_id == reply.run_id
    # The context parameter is keel's, never the model's.
    schema = json.dumps(model.calls[0].tools)
    assert "context" not in schema and "account" in schema


async def test_model_options_per_agent_and_per_turn(database: SQLiteDatabase) -> None:
    model = ScriptedModel(["one", "two"])
    agent = sqlite_agent(
        database, model, model_options=ModelOptions(temperature=0.2, seed=7, stop=("END",))
    )
    await agent.run("a", session="s1", user="u1")
    await agent.run(
        "b", session="s1", user="u1", model_options=ModelOptions(temperature=0.9, max_tokens=50)
    )
    first, second = (call.options for call in model.calls)
    assert (first.temperature, first.seed, first.stop) == (0.2, 7, ("END",))
    # Without the caller's max_tokens the answer may take what the window leaves (at most the
    # model's output limit, here smaller), never less than the reserve no prompt takes.
    assert first.max_tokens == agent.model.profile.max_output_tokens
    assert first.max_tokens >= agent.engine.budget.reserve
    assert (second.temperature, second.seed, second.max_tokens) == (0.9, None, 50)


def _booker(booked: list[str]) -> Tool:
    @tool(side_effect=True, idempotent=False)
    def book(city: str) -> str:
        """Book a trip.

        Args:
            city: Where to.
        """
        booked.append(city)
        return f"booked {city}"

    return book


def _books(call: ScriptedCall) -> Message | str:
    if call.messages[-1].role == "tool":
        return f"Done: {call.messages[-1].content}"
    return ScriptedModel.tool_call("book", json.dumps({"city": call.last_user_text.split()[-1]}))


async def test_a_turn_sent_again_with_its_turn_id_runs_once(database: SQLiteDatabase) -> None:
    booked: list[str] = []
    agent = sqlite_agent(database, ScriptedModel(_books), [_booker(booked)])
    first = await agent.run("Book Oslo", session="s1", user="u1", turn_id="req-1")
    # A retry (a timeout, a dead worker) from another process: a fresh agent, no cache.
    again = sqlite_agent(database, ScriptedModel(_books), [_booker(booked)])
    second = await again.run("Book Oslo", session="s1", user="u1", turn_id="req-1")
    assert booked == ["Oslo"]
    assert second.replayed and not first.replayed
    assert (second.text, second.run_id, second.status) == (first.text, first.run_id, "completed")
    state = again.session_state("s1")
    assert state is not None and [m.content for m in state.messages if m.role == "user"] == [
        "Book Oslo"
    ]
    # Without a turn id the same text is a new turn; the same id for another text is refused.
    await again.run("Book Oslo", session="s1", user="u1")
    assert booked == ["Oslo", "Oslo"]
    with pytest.raises(UsageError, match="another message"):
        await again.run("Book Lima", session="s1", user="u1", turn_id="req-1")
    assert booked == ["Oslo", "Oslo"]


async def test_a_turn_id_sent_again_while_its_turn_is_open_finishes_it_once(
    database: SQLiteDatabase,
) -> None:
    booked: list[str] = []
    model = ScriptedModel(_books, stream_delay_s=0.01)
    agent = sqlite_agent(database, model, [_booker(booked)])
    stream = agent.stream("Book Pune", session="s1", user="u1", turn_id="req-9")
    async for event in stream:
        if event.type == "tool_call_finished":
            break  # the client went away after the booking, before the answer
    await stream.aclose()  # type: ignore[attr-defined]
    state = agent.session_state("s1")
    assert state is not None and state.runtime.open_turn == "req-9"
    retried = await agent.run("Book Pune", session="s1", user="u1", turn_id="req-9")
    assert retried.status == "completed" and retried.resumed and booked == ["Pune"]
    replayed = await agent.run("Book Pune", session="s1", user="u1", turn_id="req-9")
    assert replayed.replayed and replayed.text == retried.text and booked == ["Pune"]
