from __future__ import annotations

import pytest

from keel import Message
from keel.errors import ModelTimeoutError, UsageError
from keel.testing import ScriptedCall, ScriptedModel


async def test_replies_in_order_and_calls_recorded() -> None:
    model = ScriptedModel(["first", ScriptedModel.tool_call("search", '{"q": "x"}'), "done"])
    prompt = [Message.system("s"), Message.user("hello")]
    first = await model.acomplete(prompt)
    assert first.message.content == "first" and first.finish_reason == "stop"
    second = await model.acomplete(
        prompt, tools=[{"type": "function", "function": {"name": "search"}}]
    )
    assert second.finish_reason == "tool_calls"
    assert second.message.tool_calls[0].name == "search"
    assert second.usage.prompt_tokens == model.counter.count_prompt(prompt, model.calls[1].tools)
    assert (await model.acomplete(prompt)).message.content == "done"
    assert len(model.calls) == 3 and model.calls[0].last_user_text == "hello"
    with pytest.raises(UsageError, match="ran out of replies"):
        await model.acomplete(prompt)


def test_function_policy_and_exceptions_sync() -> None:
    def policy(call: ScriptedCall) -> str:
        return call.last_user_text.upper()

    model = ScriptedModel(policy)
    assert model.complete([Message.user("shout")]).message.content == "SHOUT"
    failing = ScriptedModel([ModelTimeoutError("too slow")])
    with pytest.raises(ModelTimeoutError):
        failing.complete([Message.user("x")])


def test_stream_ends_with_the_whole_completion() -> None:
    chunks = list(ScriptedModel(["streamed"]).stream([Message.user("x")]))
    assert chunks[-1].completion is not None
    assert chunks[-1].completion.message.content == "streamed"
