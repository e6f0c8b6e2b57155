"""A failed model call is traced with what it cost (issue 45, item 7): ``keel runs show`` gave
``0.0 ms · 0→0 tok`` for a call that failed after a minute. Its line shows how long it took,
the prompt it was sent and what it wrote before it failed."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Sequence

import pytest

from keel.cli import main
from keel.errors import MalformedResponseError, ModelUnavailableError
from keel.messages import Message
from keel.models import CompletionChunk, ModelOptions, ToolSchema
from keel.runtime import Agent, TurnFinished
from keel.testing import ScriptedModel

_DELAY_S = 0.25
_FAILURE = "the model server went away"


class _FailsMidAnswer(ScriptedModel):
    """Streams the start of an answer, then the connection breaks; answers on the next call."""

    broke = False

    async def _astream(
        self, messages: Sequence[Message], tools: Sequence[ToolSchema], options: ModelOptions
    ) -> AsyncIterator[CompletionChunk]:
        if not self.broke:
            self.broke = True
            yield CompletionChunk(text="Let me look that up for you, one moment ")
            yield CompletionChunk(text="while I check the order history and")
            raise ModelUnavailableError(_FAILURE, model=self.spec)
        async for chunk in super()._astream(messages, tools, options):
            yield chunk


def _show(run_id: str, capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()
    assert main(["runs", "show", run_id]) == 0
    return capsys.readouterr().out


def _failed_call_line(shown: str) -> str:
    lines = shown.splitlines()
    failed = next(i for i, line in enumerate(lines) if "ModelUnavailableError" in line)
    return lines[failed - 1]


def _ms(line: str) -> float:
    found = re.search(r"· ([\d.]+) (ms|s) ·", line)
    assert found is not None, line
    value = float(found.group(1))
    return value if found.group(2) == "ms" else value * 1000


def _tokens(line: str) -> tuple[int, int]:
    found = re.search(r"(\d+)→(\d+) tok", line)
    assert found is not None, f"no tokens on the failed call's line: {line}"
    return int(found.group(1)), int(found.group(2))


def test_a_model_call_that_raised_shows_its_duration_and_prompt_tokens(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KEEL_PII_VAULT", "off")
    model = ScriptedModel([ModelUnavailableError(_FAILURE), "Your order is on its way."])
    model.delay_s = _DELAY_S  # the failure comes after a while, as a real one does
    agent = Agent.open(model=model, memory=False, system_prompt="You help customers.")
    try:
        reply = agent.handle_sync("s1", "u1", "Where is my order 1024?")
    finally:
        agent.close()
    assert reply.status == "completed"
    line = _failed_call_line(_show(reply.run_id, capsys))
    assert _ms(line) >= _DELAY_S * 1000 * 0.9, line
    prompt, _ = _tokens(line)
    assert prompt > 10, line


async def test_a_streamed_call_that_broke_shows_what_it_wrote(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KEEL_PII_VAULT", "off")
    model = _FailsMidAnswer(["Your order is on its way."])
    agent = Agent.open(model=model, memory=False, system_prompt="You help customers.")
    try:
        events = [e async for e in agent.stream("Where is my order 1024?", session="s1", user="u1")]
    finally:
        await agent.aclose()
    finished = events[-1]
    assert isinstance(finished, TurnFinished)
    run_id = finished.reply.run_id
    line = _failed_call_line(_show(run_id, capsys))
    prompt, completion = _tokens(line)
    assert prompt > 10 and completion > 5, line
    assert "Let me look that up" in _show(run_id, capsys)


def test_an_unusable_answer_that_raised_shows_the_tokens_it_wrote(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KEEL_PII_VAULT", "off")
    unusable = MalformedResponseError(
        "the reply is not valid JSON",
        raw='{"order": "1024", "status": "shipped", "carrier": "the one that',
    )
    model = ScriptedModel([unusable, "Your order is on its way."])
    agent = Agent.open(model=model, memory=False, system_prompt="You help customers.")
    try:
        reply = agent.handle_sync("s1", "u1", "Where is my order 1024?")
    finally:
        agent.close()
    shown = _show(reply.run_id, capsys)
    lines = shown.splitlines()
    failed = next(i for i, line in enumerate(lines) if "MalformedResponseError" in line)
    prompt, completion = _tokens(lines[failed - 1])
    assert prompt > 10 and completion > 5, shown
