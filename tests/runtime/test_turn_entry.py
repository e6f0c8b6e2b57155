"""The one entry of a turn (issue 46): a message loads its session once, whatever turns it
runs, and what a turn is handed of its agent is fixed while turns run."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from typing import Any

from keel.messages import Message
from keel.models import CompletionChunk, ModelOptions, ToolSchema
from keel.runtime import Agent, TextDelta
from keel.stores import SQLiteDatabase
from keel.testing import ScriptedModel
from tests.runtime.conftest import sqlite_agent

_READS = ("aload", "apeek", "aget", "aat", "load", "get")


def _count_reads(agent: Agent) -> list[str]:
    """The session reads of ``agent``'s state store, by name, as they happen."""
    reads: list[str] = []
    for name in _READS:
        original = getattr(agent.state, name)

        def counted(*args: Any, _name: str = name, _original: Any = original, **kw: Any) -> Any:
            reads.append(_name)
            return _original(*args, **kw)

        setattr(agent.state, name, counted)
    return reads


class _Slow(ScriptedModel):
    """Streams slowly, so that a consumer can stop the turn mid-answer."""

    def __init__(self) -> None:
        super().__init__(lambda call: "word " * 200, stream_delay_s=0.005)

    async def _astream(
        self, messages: Sequence[Message], tools: Sequence[ToolSchema], options: ModelOptions
    ) -> AsyncIterator[CompletionChunk]:
        async for chunk in super()._astream(messages, tools, options):
            yield chunk


async def test_a_message_reads_its_session_once(database: SQLiteDatabase) -> None:
    agent = sqlite_agent(database, ScriptedModel(lambda call: "ok"))
    await agent.handle("s1", "u1", "first")
    reads = _count_reads(agent)
    reply = await agent.handle("s1", "u1", "second")
    assert reply.status == "completed"
    assert reads == ["apeek"], reads


async def test_an_open_turn_finished_first_costs_no_second_read(
    database: SQLiteDatabase,
) -> None:
    model = _Slow()
    agent = sqlite_agent(database, model)
    stream = agent.stream("first", session="s1", user="u1")
    async for event in stream:
        if isinstance(event, TextDelta):
            break
    await stream.aclose()  # type: ignore[attr-defined]
    await asyncio.sleep(0)
    state = agent.session_state("s1")
    assert state is not None and state.runtime.open_turn is not None
    model._policy = lambda call: "done"
    reads = _count_reads(agent)
    reply = await agent.handle("s1", "u1", "second")
    # Two turns ran (the open one finished, then the message's own), on one read: the second
    # turn starts from the state the first committed.
    assert reply.interrupted_turn is not None and reply.interrupted_turn.status == "completed"
    assert reply.status == "completed" and reply.text == "done"
    assert reads == ["apeek"], reads
    stored = agent.state.load(agent.session_key("s1"))
    assert reply.state_version == stored.version
    assert [m.content for m in stored.state.messages] == ["first", "done", "second", "done"]


def test_what_a_turn_is_handed_holds_no_cache_and_no_agent_method(
    database: SQLiteDatabase,
) -> None:
    agent = sqlite_agent(database, ScriptedModel(["ok"]))
    deps = agent._hand_over().deps
    assert dataclasses.is_dataclass(deps) and type(deps).__dataclass_params__.frozen  # type: ignore[attr-defined]
    for field in dataclasses.fields(deps):
        value = getattr(deps, field.name)
        assert not isinstance(value, dict | list | set | OrderedDict), field.name
        assert not (inspect.ismethod(value) and value.__self__ is agent), field.name
    # Handed over once, and again only when the configuration changes.
    assert agent._hand_over().deps is deps
    agent.guards = agent.guards.model_copy(update={"max_steps": 3})
    assert agent._hand_over().deps.guards.max_steps == 3
