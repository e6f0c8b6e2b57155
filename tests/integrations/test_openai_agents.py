"""keel's Session inside the OpenAI Agents SDK, through the SDK's own Runner with a fake model:
each model call's input stays inside the budget with no output orphaned from its call (with or
without ``limit``: openai-agents-python#4322), older turns fold into a summary, items are masked
before they are stored, a failed write stores nothing (#4615), and a new process sees it all."""

from __future__ import annotations

import json
import random
import sqlite3
from pathlib import Path
from typing import Any

from agents import Agent, RunConfig, Runner, function_tool, set_tracing_disabled
from agents.items import ModelResponse
from agents.models.interface import Model
from agents.usage import Usage
from openai.types.responses import (
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
)

from keel.context import ContextBudget
from keel.integrations.openai_agents import SUMMARY_MARK, KeelSession
from keel.tokens import counter_for

# The SDK exports its traces to OpenAI by default: never from the tests (no network, no key).
set_tracing_disabled(True)

EMAIL = "ada@example.com"
BUDGET = ContextBudget(working_budget=4_000)


class LooksUpThenAnswers(Model):
    """Calls ``lookup`` once per user message, then answers; records every input it got."""

    def __init__(self) -> None:
        self.inputs: list[list[dict[str, Any]]] = []

    async def get_response(
        self, system_instructions: Any, input: Any, *args: Any, **kw: Any
    ) -> ModelResponse:
        items = [dict(item) for item in input] if isinstance(input, list) else []
        self.inputs.append(items)
        last = items[-1] if items else {}
        n = len(self.inputs)
        if last.get("type") == "function_call_output":
            text = ResponseOutputText(
                type="output_text", text="Here is what I found.", annotations=[]
            )
            output: Any = ResponseOutputMessage(
                id=f"m{n}", type="message", role="assistant", status="completed", content=[text]
            )
        else:
            output = ResponseFunctionToolCall(
                type="function_call", call_id=f"call-{n}", name="lookup",
                arguments=json.dumps({"item": str(last.get("content", ""))[-10:]}),
            )  # fmt: skip
        return ModelResponse(output=[output], usage=Usage(), response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


_SIZES = random.Random(11)  # seeded: tool outputs of 70 to 1,300 tokens


@function_tool
def lookup(item: str) -> str:
    """Look an item up.

    Args:
        item: what to look up.
    """
    return f"records for {item}: " + "one long line of details about it " * _SIZES.randint(10, 180)


def _orphans(items: list[dict[str, Any]]) -> list[str]:
    called = {i.get("call_id") for i in items if i.get("type") == "function_call"}
    return [
        str(i.get("call_id"))
        for i in items
        if i.get("type") == "function_call_output" and i.get("call_id") not in called
    ]


def _text_tokens(items: list[dict[str, Any]]) -> int:
    counter = counter_for("gpt-4o")
    text = []
    for item in items:
        for key in ("content", "output", "arguments"):
            value = item.get(key)
            if isinstance(value, list):  # content parts: the model reads their text
                value = "".join(str(part.get("text", "")) for part in value)
            text.append(value if isinstance(value, str) else json.dumps(value or ""))
    return counter.count_text("\n".join(text))


async def test_a_long_run_through_the_sdks_runner_stays_in_budget_and_paired(
    tmp_path: Path,
) -> None:
    database = f"sqlite:///{tmp_path / 'agents.db'}"
    session = KeelSession("u1", database=database, model="gpt-4o", budget=BUDGET)
    model = LooksUpThenAnswers()
    agent = Agent(name="helper", instructions="You look things up.", model=model, tools=[lookup])
    # The filter fits each call's whole input, the turn in progress included (its tool output
    # is not in the session yet when the history is read).
    config = RunConfig(call_model_input_filter=session.input_filter)
    for turn in range(30):
        text = f"Turn {turn}: item {turn:04d}, reach me at {EMAIL}"
        result = await Runner.run(agent, text, session=session, run_config=config)
        assert result.final_output == "Here is what I found."
    assert len(model.inputs) == 60
    limit = session.engine.budget.limit
    for sent in model.inputs:
        assert not _orphans(sent), "an output was sent without its call"
        assert _text_tokens(sent) <= limit
    late = model.inputs[-1]
    assert sum(1 for i in late if str(i.get("content", "")).startswith(SUMMARY_MARK)) == 1
    assert "Turn 29:" in json.dumps(late) and "Turn 0:" not in json.dumps(late)
    assert _text_tokens(model.inputs[-1]) < 1.5 * _text_tokens(model.inputs[20]), "not flat"
    stored = await session.all_items()
    assert len(stored) == 30 * 4, "every item is kept in the store, whatever the model saw"
    with sqlite3.connect(tmp_path / "agents.db") as conn:
        assert EMAIL not in "\n".join(conn.iterdump()), "an e-mail reached storage unmasked"
    again = KeelSession("u1", database=database, model="gpt-4o", budget=BUDGET)
    assert await again.all_items() == stored, "another process sees the same history"


async def test_limit_never_cuts_an_output_from_its_call(tmp_path: Path) -> None:
    session = KeelSession("u1", database=f"sqlite:///{tmp_path / 'a.db'}", model="gpt-4o")
    await session.add_items(
        [
            {"role": "user", "content": "book it"},
            {"type": "function_call", "call_id": "c1", "name": "book", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "mail", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "booked"},
            {"type": "function_call_output", "call_id": "c2", "output": "mailed"},
            {"role": "assistant", "content": "Done."},
        ]
    )
    for limit in range(1, 7):
        newest = await session.get_items(limit=limit)
        assert not _orphans(newest), (limit, newest)
        assert newest[-1] == {"role": "assistant", "content": "Done."}
    assert len(await session.get_items(limit=2)) == 5  # back to both calls of the response


async def test_a_failed_write_stores_nothing_and_pop_and_clear_work(tmp_path: Path) -> None:
    session = KeelSession("u1", database=f"sqlite:///{tmp_path / 'a.db'}", model="gpt-4o")
    await session.add_items([{"role": "user", "content": "hello"}])
    broken = [
        {"type": "function_call", "call_id": "c1", "name": "book", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": object()},
    ]
    try:
        await session.add_items(broken)
    except TypeError:
        pass
    else:
        raise AssertionError("an item that cannot be stored was accepted")
    assert await session.all_items() == [{"role": "user", "content": "hello"}], "half a turn"
    assert await session.pop_item() == {"role": "user", "content": "hello"}
    assert await session.pop_item() is None
    await session.add_items([{"role": "user", "content": "again"}])
    await session.clear_session()
    assert await session.get_items() == []
