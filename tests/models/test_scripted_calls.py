"""What a ScriptedModel keeps of the calls it was sent: every one, or the newest ``keep_calls``."""

from __future__ import annotations

from pathlib import Path

import pytest

from keel.errors import UsageError
from keel.runtime import Agent
from keel.settings import load_settings
from keel.testing import ScriptedModel


async def test_keep_calls_keeps_the_newest_calls_and_by_default_every_one(tmp_path: Path) -> None:
    every = ScriptedModel(lambda call: f"re: {call.last_user_text}")
    newest = ScriptedModel(lambda call: f"re: {call.last_user_text}", keep_calls=2)
    none = ScriptedModel(lambda call: f"re: {call.last_user_text}", keep_calls=0)
    for number, model in enumerate((every, newest, none)):
        settings = load_settings(data_dir=tmp_path / str(number))
        agent = Agent.embedded(model, system_prompt="hi", memory=False, settings=settings)
        for turn in range(4):
            reply = await agent.handle("s", "u", f"question {turn}")
            assert reply.text == f"re: question {turn}"
        await agent.aclose()
    assert [call.last_user_text for call in every.calls] == [f"question {n}" for n in range(4)]
    assert [call.last_user_text for call in newest.calls] == ["question 2", "question 3"]
    assert none.calls == []


def test_keep_calls_below_zero_is_refused() -> None:
    with pytest.raises(UsageError, match="keep_calls"):
        ScriptedModel(["hi"], keep_calls=-1)
