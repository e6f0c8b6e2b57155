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

from keel.context import ContextBudget
from keel.integrations.openai_agents import SUMMARY_MARK, KeelSession
from keel.testing.openai_agents import LooksUpThenAnswers, orphaned_outputs, text_tokens
from keel.tokens import counter_for

# The SDK exports its traces to OpenAI by default: never from the tests (no network, no key).
set_tracing_disabled(True)

EMAIL = "ada@example.com"
BUDGET = ContextBudget(working_budget=4_000)


_SIZES = random.Random(11)  # seeded: tool outputs of 70 to 1,300 tokens


@function_tool
def lookup(item: str) -> str:
    """Look an item up.

    Args:
        item: what to look up.
    """
    return f"records for {item}: " + "one long line of details about it " * _SIZES.randint(10, 180)


def _orphans(items: list[dict[str, Any]]) -> list[str]:
    return orphaned_outputs(items)


def _text_tokens(items: list[dict[str, Any]]) -> int:
    return text_tokens(items, counter_for("gpt-4o"))


async def test_a_long_run_through_the_sdks_runner_stays_in_budget_and_paired(
    tmp_path: Path,
) -> None:
    database = f"sqlite:///{tmp_path / 'agents.db'}"
    session = KeelSession("u1", database=database, model="gpt-4o", budget=BUDGET)
    model = LooksUpThenAnswers(answer="Here is what I found.")
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
