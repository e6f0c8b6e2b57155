"""A long answer is not thrown away: a reply cut at the token limit is continued into one
answer, within the run's step and time limits; only one that still cannot finish is reported cut
(DESIGN.md, "The answer's limit")."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

from keel.context import is_runtime_note
from keel.guards import GuardConfig
from keel.messages import Message, Usage
from keel.models import Completion, ModelOptions, ToolSchema
from keel.runtime import Agent
from keel.settings import load_settings
from keel.stores import SQLiteDatabase
from keel.testing import ScriptedModel
from tests.runtime.conftest import sqlite_agent

STORY = ["Once upon a time, a fox ", "lived in a quiet wood, far from the ", "road. The end."]


def _cut(text: str) -> Completion:
    """A reply the token limit cut (what a provider returns with ``allow_truncated``)."""
    return Completion(
        message=Message.assistant(text),
        finish_reason="length",
        usage=Usage(prompt_tokens=20, completion_tokens=8),
        model="scripted",
        latency_ms=1.0,
    )


async def test_an_answer_cut_at_the_token_limit_is_continued_into_one_reply(
    database: SQLiteDatabase,
) -> None:
    model = ScriptedModel([_cut(STORY[0]), _cut(STORY[1]), STORY[2]])
    agent = sqlite_agent(database, model)
    reply = await agent.run("Write a long story.", session="s1", user="u1")
    assert reply.status == "completed" and not reply.truncated and reply.error is None
    assert reply.text == "".join(STORY) and reply.steps == 3
    # Each continuation sees what the model wrote so far, as its own, and keel's request to
    # go on from there, in keel's name: never the user's words, gone when the turn ends.
    second = model.calls[1].messages
    assert (second[-2].role, second[-2].content) == ("assistant", STORY[0])
    assert second[-1].role == "system" and is_runtime_note(second[-1])
    assert "Continue it exactly where it stopped" in second[-1].content
    assert [m.role for m in second if m.role != "system"] == ["user", "assistant"]
    assert [m.content for m in model.calls[2].messages if m.role == "assistant"] == STORY[:2]
    # The history keeps one answer: the parts joined, no request to continue.
    state = agent.session_state("s1")
    assert state is not None
    assert [(m.role, m.content) for m in state.messages] == [
        ("user", "Write a long story."),
        ("assistant", "".join(STORY)),
    ]


async def test_the_callers_max_tokens_caps_each_call_and_a_cut_answer_still_continues(
    database: SQLiteDatabase,
) -> None:
    model = ScriptedModel([_cut(STORY[0]), STORY[1] + STORY[2]])
    agent = sqlite_agent(database, model, model_options=ModelOptions(max_tokens=24))
    reply = await agent.run("Write a long story.", session="s1", user="u1")
    assert reply.text == "".join(STORY) and not reply.truncated
    assert [call.options.max_tokens for call in model.calls] == [24, 24]


async def test_an_answer_that_cannot_finish_within_the_step_limit_is_reported_cut(
    database: SQLiteDatabase,
) -> None:
    model = ScriptedModel([*(_cut(part) for part in STORY), "You are welcome."])
    agent = sqlite_agent(database, model, guards=GuardConfig(max_steps=3))
    reply = await agent.run("Write a long story.", session="s1", user="u1")
    # Not a failure, not a step_limit apology: the answer as far as it got, flagged cut.
    assert reply.status == "completed" and reply.truncated
    assert reply.text == "".join(STORY) and reply.steps == 3 and not reply.reverted
    state = agent.session_state("s1")
    assert state is not None
    assert [m.content for m in state.messages if m.role == "assistant"] == ["".join(STORY)]
    # A whole answer on the next turn is not flagged.
    whole = await agent.run("Thanks.", session="s1", user="u1")
    assert whole.text == "You are welcome." and not whole.truncated


class _CutThenStalls(ScriptedModel):
    """Its first answer is cut at the token limit; the continuation never comes."""

    def __init__(self) -> None:
        super().__init__([_cut(STORY[0])])
        self.asked = 0

    async def _acomplete(
        self, messages: Sequence[Message], tools: Sequence[ToolSchema], options: ModelOptions
    ) -> Completion:
        self.asked += 1
        if self.asked > 1:
            await asyncio.Event().wait()
        return await super()._acomplete(messages, tools, options)


async def test_an_answer_the_time_limit_cuts_while_it_is_continued_is_reported_cut(
    database: SQLiteDatabase,
) -> None:
    model = _CutThenStalls()
    guards = GuardConfig(run_timeout_s=1.0, model_timeout_s=30.0)
    agent = sqlite_agent(database, model, guards=guards)
    reply = await agent.run("Write a long story.", session="s1", user="u1")
    assert model.asked == 2  # the continuation was asked for, and never came
    assert reply.status == "completed" and reply.truncated and reply.text == STORY[0]


async def test_a_provider_over_http_hands_its_cut_answer_to_the_agent_to_continue(
    tmp_path: Path,
) -> None:
    from keel.models import OpenAICompatibleModel, RetryPolicy
    from keel.testing import FaultServer

    with FaultServer() as server:
        # ``length``: every answer is cut at max_tokens ("Hello from the fault ser").
        model = OpenAICompatibleModel(
            "length", base_url=server.base_url, api_key="x", retry=RetryPolicy.none()
        )
        try:
            async with Agent.embedded(
                model,
                system_prompt="You help.",
                memory=False,
                guards=GuardConfig(max_steps=3),
                settings=load_settings(data_dir=tmp_path),
            ) as agent:
                reply = await agent.run("Write a long story.", session="s1", user="u1")
                reserve = agent.engine.budget.reserve
        finally:
            await model.aclose()
    assert server.count("length") == 3
    assert reply.status == "completed" and reply.truncated
    assert reply.text == "Hello from the fault ser" * 3
    # Each request asked for what its prompt left, up to the model's own output limit (more
    # than the reserve: these prompts are small).
    asked = [request.body["max_tokens"] for request in server.requests]
    assert asked == [model.profile.max_output_tokens] * 3
    assert reserve < model.profile.max_output_tokens
