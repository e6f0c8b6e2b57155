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

import pytest
from agents import (
    Agent,
    RunConfig,
    Runner,
    SessionSettings,
    function_tool,
    set_tracing_disabled,
)

from keel.context import ContextBudget, ExtractiveSummarizer
from keel.integrations.openai_agents import SUMMARY_MARK, KeelSession
from keel.testing import ScriptedModel
from keel.testing.openai_agents import LooksUpThenAnswers, orphaned_outputs, text_tokens
from keel.tokens import counter_for

# The SDK exports its traces to OpenAI by default: never from the tests (no network, no key).
set_tracing_disabled(True)

EMAIL = "ada@example.com"
BUDGET = ContextBudget(working_budget=4_000)


_SIZES = random.Random(11)  # seeded: tool outputs of 70 to 1,300 tokens


@pytest.fixture(autouse=True)
def _same_sizes_in_any_order() -> None:
    """Every test sees the same tool outputs, whichever tests of this module ran before it (a
    shared generator made a test's data depend on the random test order)."""
    _SIZES.seed(11)


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
    lengths = []
    for limit in range(1, 8):
        newest = await session.get_items(limit=limit)
        assert not _orphans(newest), (limit, newest)
        assert newest[-1] == {"role": "assistant", "content": "Done."}
        lengths.append(len(newest))
    # At most ``limit``; an output whose call the cut leaves out goes with it.
    assert lengths == [1, 1, 1, 1, 5, 6, 6]


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


SMALL = ContextBudget(working_budget=1_500)


async def _turns(session: KeelSession, model: LooksUpThenAnswers, count: int, **run: Any) -> None:
    agent = Agent(name="helper", instructions="You look things up.", model=model, tools=[lookup])
    for turn in range(count):
        result = await Runner.run(agent, f"Turn {turn}: item {turn:04d}", session=session, **run)
        assert result.final_output == "Found it."


def _history_sent(model: LooksUpThenAnswers) -> list[dict[str, Any]]:
    """What the model got from the session on the newest turn's first call (its input
    without the turn's own user message)."""
    first_call = model.inputs[-2]
    assert first_call[-1].get("role") == "user"
    return first_call[:-1]


async def test_the_runners_session_limit_is_at_most_that_many_items(tmp_path: Path) -> None:
    """``SessionSettings(limit=3)``: the runner gets at most 3 items, the summary counted
    among them, and none is an output without its call."""
    session = KeelSession("u1", database=f"sqlite:///{tmp_path / 'a.db'}", budget=SMALL)
    model = LooksUpThenAnswers()
    await _turns(session, model, 8)
    assert str((await session.get_items())[0]["content"]).startswith(SUMMARY_MARK)
    for limit in (1, 2, 3, 4, 5):
        settings = RunConfig(session_settings=SessionSettings(limit=limit))
        await _turns(session, model, 1, run_config=settings)
        sent = _history_sent(model)
        assert len(sent) <= limit and not _orphans(sent), (limit, sent)
    session.close()


async def test_the_summarizer_is_chosen_a_model_or_the_extractive_one(tmp_path: Path) -> None:
    """A ``ChatModel`` writes the summary the runner's model reads; by default keel's
    extractive summarizer does, without a model call."""
    writer = ScriptedModel(["Decisions:\n- the user looks items up one by one"], repeat_last=True)
    database = f"sqlite:///{tmp_path / 'a.db'}"
    sent: dict[str, str] = {}
    for name, summarizer in (("model", writer), ("extractive", None)):
        session = KeelSession(name, database=database, budget=SMALL, summarizer=summarizer)
        model = LooksUpThenAnswers()
        await _turns(session, model, 8)
        summaries = [
            i for i in _history_sent(model) if str(i.get("content", "")).startswith(SUMMARY_MARK)
        ]
        assert len(summaries) == 1, name
        sent[name] = str(summaries[0]["content"])[len(SUMMARY_MARK) :]
        session.close()
    assert sent["model"] == "Decisions:\n- the user looks items up one by one"
    assert writer.calls, "the chosen model wrote the summary"
    assert "Turn" in sent["extractive"] and sent["extractive"] != sent["model"]
    assert isinstance(KeelSession("x", database=database).engine.summarizer, ExtractiveSummarizer)


def _open_files(path: Path) -> int:
    """How many of this process's file descriptors are open on ``path`` (or its WAL)."""
    fds = Path("/proc/self/fd")
    found = 0
    for fd in fds.iterdir():
        try:
            target = str(fd.readlink())
        except OSError:
            continue
        found += target.startswith(str(path))
    return found


async def test_close_releases_the_database_the_session_opened(tmp_path: Path) -> None:
    path = tmp_path / "a.db"
    async with KeelSession("u1", database=f"sqlite:///{path}") as session:
        await _turns(session, LooksUpThenAnswers(), 1)
        assert _open_files(path) > 0
    assert _open_files(path) == 0
    shared = KeelSession("u1", database=f"sqlite:///{path}").state
    session = KeelSession("u2", state=shared)
    await _turns(session, LooksUpThenAnswers(), 1)
    session.close()
    assert await KeelSession("u3", state=shared).get_items() == [], "a store passed in stays open"
    shared.close()
    assert _open_files(path) == 0
