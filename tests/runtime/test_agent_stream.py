"""Agent.stream where users stand: typed events through the real Agent on SQLite, with every
invariant of a turn kept while it streams (checkpoint first, masked text, a consumer or a model
that stops mid-way leaves the session at its last checkpoint, resumable)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from typing import get_args

import pytest
from pydantic import TypeAdapter

from keel.errors import ModelError
from keel.guards import GuardConfig
from keel.messages import Message, Usage
from keel.models import Completion, CompletionChunk, ModelOptions, ToolSchema
from keel.runtime import (
    Agent,
    AgentEvent,
    AgentStatus,
    CheckpointCommitted,
    LoopStatus,
    TextDelta,
    TextDiscarded,
    ToolCallFinished,
    ToolCallStarted,
    TurnFinished,
)
from keel.state import AgentState, StateStore
from keel.stores import SQLiteDatabase, SQLStateBackend
from keel.testing import ScriptedCall, ScriptedModel
from keel.tools import Tool, tool
from tests.runtime.conftest import sqlite_agent

_EMAIL = "jane.doe@example.com"
_ANSWER = f"Found it. Write to {_EMAIL} or call (415) 555-0198 about booking number seven."


def _lookup(ran: list[str]) -> Tool:
    @tool
    def lookup(query: str) -> str:
        """Look records up.

        Args:
            query: What to look up.
        """
        ran.append(query)
        return f"record of {query}"

    return lookup


def _looks_up_then_answers(call: ScriptedCall) -> Message | str:
    if call.messages[-1].role == "tool":
        return _ANSWER
    return ScriptedModel.tool_call("lookup", json.dumps({"query": _EMAIL}))


async def _events(agent: Agent, text: str, session: str = "s1") -> list[AgentEvent]:
    return [event async for event in agent.stream(text, session=session, user="u1")]


async def test_a_streamed_turn_yields_masked_typed_events_and_ends_as_run_does(
    database: SQLiteDatabase,
) -> None:
    ran: list[str] = []
    agent = sqlite_agent(database, ScriptedModel(_looks_up_then_answers), [_lookup(ran)])
    events = await _events(agent, "find my booking")
    assert isinstance(events[-1], TurnFinished)
    reply = events[-1].reply
    assert reply.status == "completed" and ran == [_EMAIL]
    # Every event is one of the union, and none carries PII unmasked.
    dumped = TypeAdapter(list[AgentEvent]).dump_json(events).decode()
    assert _EMAIL not in dumped and "555-0198" not in dumped
    assert TypeAdapter(list[AgentEvent]).validate_json(dumped) == events
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    assert text == reply.text and "<EMAIL_1>" in text
    assert len([e for e in events if isinstance(e, TextDelta)]) > 1, "the text did not stream"
    kinds = [type(e).__name__ for e in events]
    # A checkpoint before each model call: before the tool call of step 0, before the text of
    # step 1; the turn's commit after the text, then the reply.
    assert kinds.index("CheckpointCommitted") < kinds.index("ToolCallStarted")
    started = next(e for e in events if isinstance(e, ToolCallStarted))
    assert started.arguments == {"query": "<EMAIL_1>"}
    finished = next(e for e in events if isinstance(e, ToolCallFinished))
    assert finished.ok and finished.result == "record of <EMAIL_1>"
    first_text = kinds.index("TextDelta")
    checkpoints = [i for i, e in enumerate(events) if isinstance(e, CheckpointCommitted)]
    assert [events[i].reason for i in checkpoints] == [  # type: ignore[union-attr]
        "before model call",
        "before model call",
        "turn completed",
    ]
    assert checkpoints[1] < first_text < checkpoints[2]
    assert reply.state_version == events[checkpoints[2]].version  # type: ignore[union-attr]
    # The committed session is the one an unstreamed turn commits.
    plain = sqlite_agent(database, ScriptedModel(_looks_up_then_answers), [_lookup([])])
    unstreamed = await plain.run("find my booking", session="s2", user="u1")
    assert unstreamed.text == reply.text
    streamed_state, plain_state = agent.session_state("s1"), plain.session_state("s2")
    assert streamed_state is not None and plain_state is not None
    assert [(m.role, m.content) for m in streamed_state.messages] == [
        (m.role, m.content) for m in plain_state.messages
    ]


class _CutOnce(ScriptedModel):
    """Streams part of its first reply, then the connection drops."""

    def __init__(self) -> None:
        super().__init__(lambda call: _ANSWER + " " + "more words " * 20)
        self.cut = False

    async def _astream(
        self, messages: Sequence[Message], tools: Sequence[ToolSchema], options: ModelOptions
    ) -> AsyncIterator[CompletionChunk]:
        pieces = 0
        async for chunk in super()._astream(messages, tools, options):
            if not self.cut and pieces == 60:
                self.cut = True
                raise ModelError("the stream broke after 60 chunks", model=self.spec)
            pieces += 1
            yield chunk


async def test_a_stream_cut_mid_way_is_withdrawn_and_the_answer_is_asked_again(
    database: SQLiteDatabase,
) -> None:
    agent = sqlite_agent(database, _CutOnce(), [])
    events = await _events(agent, "hello")
    discarded = [e for e in events if isinstance(e, TextDiscarded)]
    assert len(discarded) == 1 and "broke" in discarded[0].reason
    reply = events[-1].reply  # type: ignore[union-attr]
    assert reply.status == "completed"
    after = events.index(discarded[0])
    kept = "".join(e.text for e in events[after:] if isinstance(e, TextDelta))
    assert kept == reply.text
    state = agent.session_state("s1")
    assert state is not None
    assert [m.role for m in state.messages] == ["user", "assistant"]


async def test_unmasked_text_streams_as_it_comes_and_is_withdrawn_the_same_way(
    database: SQLiteDatabase,
) -> None:
    agent = Agent(
        _CutOnce(),
        state=StateStore(SQLStateBackend(database), AgentState),
        system_prompt="You help.",
        masker=None,
    )
    events = await _events(agent, "hello")
    deltas = [e for e in events if isinstance(e, TextDelta)]
    # Each of the model's 4-character chunks comes out as it arrives.
    assert max(len(e.text) for e in deltas) == 4, "chunks were held back without a masker"
    assert len([e for e in events if isinstance(e, TextDiscarded)]) == 1
    assert events[-1].reply.status == "completed"  # type: ignore[union-attr]


async def test_an_answer_cut_at_the_token_limit_streams_on_masked_whole_across_the_cut(
    database: SQLiteDatabase,
) -> None:
    # The cut falls inside an e-mail address: each part alone does not look like one.
    cut_at = _ANSWER.index("@example") + 4
    cut = Completion(
        message=Message.assistant(_ANSWER[:cut_at]),
        finish_reason="length",
        usage=Usage(prompt_tokens=5, completion_tokens=9),
        model="scripted",
        latency_ms=1.0,
    )
    agent = sqlite_agent(database, ScriptedModel([cut, _ANSWER[cut_at:]]), [])
    events = await _events(agent, "hello")
    reply = events[-1].reply  # type: ignore[union-attr]
    assert reply.status == "completed" and not reply.truncated and reply.steps == 2
    # The cut part stands (nothing withdrawn) and the stream goes on from it: what streamed is
    # the reply, the address masked whole, no piece of it shown.
    assert not any(isinstance(e, TextDiscarded) for e in events)
    streamed = "".join(e.text for e in events if isinstance(e, TextDelta))
    assert streamed == reply.text == agent.masker.mask_text(_ANSWER)  # type: ignore[union-attr]
    assert "<EMAIL_1>" in streamed and "jane" not in streamed and "example" not in streamed


async def test_an_answer_the_step_limit_leaves_cut_streams_all_of_what_was_written(
    database: SQLiteDatabase,
) -> None:
    parts = ["The fox walked ", "through the quiet wood at dusk, looking for ", "its way home"]
    cut = [
        Completion(
            message=Message.assistant(part),
            finish_reason="length",
            usage=Usage(prompt_tokens=5, completion_tokens=9),
            model="scripted",
            latency_ms=1.0,
        )
        for part in parts
    ]
    agent = sqlite_agent(database, ScriptedModel(cut), [], guards=GuardConfig(max_steps=3))
    events = await _events(agent, "hello")
    reply = events[-1].reply  # type: ignore[union-attr]
    assert reply.status == "completed" and reply.truncated and reply.text == "".join(parts)
    # Nothing withdrawn; the tail the masker held back comes out when the answer ends cut.
    assert not any(isinstance(e, TextDiscarded) for e in events)
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == reply.text


async def test_a_failed_call_while_an_answer_is_continued_keeps_what_streamed_of_it(
    database: SQLiteDatabase,
) -> None:
    first = "The fox walked through the quiet wood at dusk, looking for "
    cut = Completion(
        message=Message.assistant(first),
        finish_reason="length",
        usage=Usage(prompt_tokens=5, completion_tokens=9),
        model="scripted",
        latency_ms=1.0,
    )
    model = ScriptedModel([cut, ModelError("503 from the provider"), "its way home."])
    agent = sqlite_agent(database, model, [])
    events = await _events(agent, "hello")
    reply = events[-1].reply  # type: ignore[union-attr]
    assert reply.status == "completed" and reply.text == first + "its way home."
    # The failed call showed nothing and withdrew nothing: the answer's first part stands.
    assert not any(isinstance(e, TextDiscarded) for e in events)
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == reply.text
    assert [m.role for m in model.calls[2].messages[-2:]] == ["assistant", "system"]


class _Endless(ScriptedModel):
    """Streams slowly; records whether its stream was closed."""

    def __init__(self) -> None:
        super().__init__(lambda call: "word " * 400, stream_delay_s=0.005)
        self.closed = asyncio.Event()

    async def _astream(
        self, messages: Sequence[Message], tools: Sequence[ToolSchema], options: ModelOptions
    ) -> AsyncIterator[CompletionChunk]:
        try:
            async for chunk in super()._astream(messages, tools, options):
                yield chunk
        finally:
            self.closed.set()


async def test_a_consumer_that_stops_early_stops_the_model_and_leaves_the_turn_resumable(
    database: SQLiteDatabase,
) -> None:
    model = _Endless()
    agent = sqlite_agent(database, model, [])
    stream = agent.stream("first", session="s1", user="u1")
    seen: list[AgentEvent] = []
    async for event in stream:
        seen.append(event)
        if isinstance(event, TextDelta):
            break
    await stream.aclose()  # type: ignore[attr-defined]
    assert model.closed.is_set(), "the model request kept running"
    state = agent.session_state("s1")
    assert state is not None
    # At the checkpoint before the model call: the user's message, the turn still open.
    assert [m.content for m in state.messages] == ["first"]
    assert state.runtime.open_turn is not None
    model._policy = lambda call: "done"  # the model now answers at once
    resumed = await agent.resume("s1", "u1")
    assert resumed is not None and resumed.status == "completed"
    state = agent.session_state("s1")
    assert state is not None and [m.content for m in state.messages] == ["first", "done"]


def test_the_sync_twin_streams_and_stops_early_the_same_way(database: SQLiteDatabase) -> None:
    model = _Endless()
    agent = sqlite_agent(database, model, [])
    kinds = []
    for event in agent.stream_sync("first", session="s1", user="u1"):
        kinds.append(event.type)
        if event.type == "text":
            break
    assert kinds[0] == "checkpoint" and kinds[-1] == "text"
    state = agent.session_state("s1")
    assert state is not None and state.runtime.open_turn is not None
    model._policy = lambda call: "done"
    final = list(agent.stream_sync("second", session="s1", user="u1"))
    reply = final[-1]
    assert isinstance(reply, TurnFinished) and reply.reply.text == "done"
    assert reply.reply.interrupted_turn is not None
    agent.close()


async def test_identities_are_keyword_only(database: SQLiteDatabase) -> None:
    agent = sqlite_agent(database, ScriptedModel(["hi"]), [])
    with pytest.raises(TypeError):
        await agent.run("hello", "s1", "u1")  # type: ignore[misc]
    reply = await agent.run("hello", session="s1", user="u1")
    assert reply.status == "completed" and reply.session_id == "s1"


def test_reply_statuses_are_the_loop_statuses_failed_and_escalated() -> None:
    assert set(get_args(AgentStatus)) == {*get_args(LoopStatus), "failed", "escalated"}


async def test_streamed_prefixes_stay_out_of_the_maskers_cache(database: SQLiteDatabase) -> None:
    from keel.privacy import PIIMasker

    masker = PIIMasker()
    agent = Agent(
        ScriptedModel(["word " * 80]),
        state=StateStore(SQLStateBackend(database), AgentState),
        system_prompt="You help.",
        masker=masker,
    )
    events = await _events(agent, "hello")
    assert len([e for e in events if isinstance(e, TextDelta)]) > 40
    cached = sum(len(results) for _, results in masker._results.values())
    # The messages (user text, the reply) are cached, not each of the 100 prefixes streamed.
    assert cached < 10, cached


async def test_a_streamed_json_text_in_a_json_string_shows_no_value_before_its_placeholder(
    database: SQLiteDatabase,
) -> None:
    # A reply that is a JSON text held in a JSON string: its "\\n" is a line break before the
    # IBAN. The word "hello\\nGB82" read alone (a backslash, "nGB82": no IBAN starts there)
    # released the IBAN's first group, one character at a time, before the rest came.
    inner = {"a": "caf\u00e9", "n": "ok hello\nGB82 WEST 1234 5698 7654 32 ok"}
    answer = json.dumps({"content": json.dumps(inner)})
    agent = sqlite_agent(database, ScriptedModel([answer], stream_chunk_chars=1), [])
    events = await _events(agent, "export it")
    assert isinstance(events[-1], TurnFinished)
    reply = events[-1].reply
    streamed = "".join(e.text for e in events if isinstance(e, TextDelta))
    assert "GB82" not in streamed, streamed
    assert streamed == reply.text and "<IBAN_1>" in streamed


@pytest.mark.parametrize(
    "begin",
    [
        "-----BE\u200bGIN PRIVATE KEY-----",  # an invisible character inside
        "\\u002d----BEGIN PRIVATE KEY-----",  # in JSON, a dash escaped
    ],
)
async def test_a_streamed_private_key_whose_begin_line_is_written_oddly_is_never_shown(
    database: SQLiteDatabase, begin: str
) -> None:
    # The mask reads "-----BEGIN" as the detectors read the text and masks the key once its
    # END comes; the stream looked for "-----BEGIN" as written, found none, and released the
    # key's body 64 characters behind what had come.
    body = "\\n".join(f"MIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcwggSjAgEAAoIBAQC{i}" for i in range(8))
    answer = f'{{"key": "{begin}\\n{body}\\n-----END PRIVATE KEY-----", "ok": true}}'
    agent = sqlite_agent(database, ScriptedModel([answer], stream_chunk_chars=7), [])
    events = await _events(agent, "show the key")
    assert isinstance(events[-1], TurnFinished)
    reply = events[-1].reply
    streamed = "".join(e.text for e in events if isinstance(e, TextDelta))
    assert "MIIEvQ" not in streamed, streamed
    assert streamed == reply.text and "<PRIVATE_KEY_1>" in streamed


async def test_a_reply_whose_escapes_read_another_way_late_streams_all_of_it_masked(
    database: SQLiteDatabase,
) -> None:
    # A log line quoted twice escaped: until the late "\\u00fc" the text reads "\" then
    # "nnina@...", so "\<EMAIL_1>" is released; the whole, decoded twice, masks "\\n<EMAIL_1>",
    # which no longer starts with what was shown: the rest of the reply was dropped.
    answer = (
        "The log reads: Hello,\\\\nnina@example.com "
        + "is the address on file for this booking, " * 3
        + "and the office is in Z\\\\u00fcrich. Write back any time, we answer within a day."
    )
    agent = sqlite_agent(database, ScriptedModel([answer], stream_chunk_chars=7), [])
    events = await _events(agent, "read me the log")
    assert isinstance(events[-1], TurnFinished)
    reply = events[-1].reply
    streamed = "".join(e.text for e in events if isinstance(e, TextDelta))
    assert "nina@" not in streamed and "<EMAIL_1>" in streamed
    # Everything after the address is shown, as the whole masks it.
    assert streamed.partition("<EMAIL_1>")[2] == reply.text.partition("<EMAIL_1>")[2], streamed
