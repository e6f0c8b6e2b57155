"""The executor: every outcome is a result the model can act on, never a crash."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from pathlib import Path
from typing import Annotated, Any

import pytest
from pydantic import Field

from keel.errors import (
    ToolArgumentsError,
    ToolExecutionError,
    ToolInDoubtError,
    UnknownToolError,
)
from keel.messages import ToolCall
from keel.stores import SQLiteDatabase, SQLToolJournal
from keel.tools import (
    InMemoryJournal,
    JournalEntry,
    Tool,
    ToolContext,
    ToolExecutor,
    ToolRegistry,
    ToolScope,
    idempotency_key,
    tool,
)
from keel.tools._executor import LATE_NOTE

executions: list[str] = []


@tool(side_effect=True, idempotent=False)
def book_flight(
    flight: str,
    passengers: Annotated[int, Field(ge=1)],
    ctx: ToolContext | None = None,
) -> str:
    """Book seats on a flight."""
    executions.append(ctx.idempotency_key if ctx else "")
    return f"booked {passengers} on {flight}"


@tool(side_effect=True, idempotent=True)
def hold_seat(seat: str) -> str:
    """Hold a seat."""
    executions.append(seat)
    return f"held {seat}"


@tool
def explode(reason: str) -> str:
    """Always fails."""
    raise ValueError(reason)


@tool(timeout_s=0.05)
async def slow(seconds: float) -> str:
    """Sleeps."""
    await asyncio.sleep(seconds)
    return "done"


@tool(max_output_chars=20)
def report(lines: int) -> dict[str, list[str]]:
    """A big report."""
    return {"lines": [f"line {i}" for i in range(lines)]}


@pytest.fixture(autouse=True)
def _clear() -> None:
    executions.clear()


def _executor(journal: InMemoryJournal | None = None) -> ToolExecutor:
    registry = ToolRegistry([book_flight, hold_seat, explode, slow, report])
    return ToolExecutor(registry, journal=journal)


async def _run(executor: ToolExecutor, name: str, arguments: str, step: int = 1):  # type: ignore[no-untyped-def]
    call = ToolCall(id="call_1", name=name, arguments=arguments)
    return await executor.execute(call, session_id="s1", step=step, call_index=0)


async def test_unknown_tool_names_the_closest_valid_tools() -> None:
    result = await _run(_executor(), "book_flights", "{}")
    assert result.status == "unknown_tool" and not result.ok
    assert "Did you mean: book_flight?" in result.content
    assert "Available tools: book_flight, hold_seat, explode, slow, report." in result.content
    assert isinstance(result.exception, UnknownToolError)
    assert result.exception.suggestions == ["book_flight"]


async def test_schema_violations_give_one_line_per_field() -> None:
    result = await _run(_executor(), "book_flight", '{"flight": 7, "passengers": "two", "x": 1}')
    assert result.status == "invalid_arguments"
    assert result.problems == (
        "Field 'flight': Input should be a valid string",
        "Field 'passengers': Input should be a valid integer",
        "Field 'x': Extra inputs are not permitted",
        "Valid arguments: flight, passengers.",
    )
    assert "Field 'passengers': Input should be a valid integer\n" in result.content
    assert isinstance(result.exception, ToolArgumentsError)
    assert executions == []


async def test_missing_and_constrained_fields() -> None:
    result = await _run(_executor(), "book_flight", '{"passengers": 0}')
    assert result.problems == (
        "Field 'flight': Field required",
        "Field 'passengers': Input should be greater than or equal to 1",
    )


async def test_repairable_arguments_run_and_record_the_repairs() -> None:
    result = await _run(
        _executor(), "book_flight", "```json\n{'flight': 'AF1', 'passengers': '2',}\n```"
    )
    assert result.ok and result.content == "booked 2 on AF1"
    assert result.arguments == {"flight": "AF1", "passengers": 2}
    assert result.repairs == (
        "removed a markdown code fence",
        "read single-quoted (Python-style) arguments",
        "argument 'passengers': string '2' read as integer 2",
    )


async def test_unrepairable_arguments_are_an_error_for_the_model() -> None:
    result = await _run(_executor(), "book_flight", '{"flight": "AF1", "passengers": ')
    assert result.status == "invalid_arguments"
    assert "cut off" in result.content and executions == []


async def test_a_tool_exception_is_a_structured_failure() -> None:
    result = await _run(_executor(), "explode", '{"reason": "no seats left"}')
    assert result.status == "failed" and result.executed
    assert result.content == "Error: tool 'explode' failed: ValueError: no seats left"
    assert isinstance(result.exception, ToolExecutionError)
    assert isinstance(result.exception.__cause__, ValueError)


async def test_per_tool_timeout() -> None:
    result = await _run(_executor(), "slow", '{"seconds": 5}')
    assert result.status == "timeout"
    assert "did not finish within 0.05 s" in result.content
    assert result.latency_ms < 2000


async def test_output_cap_truncates_for_the_model_and_keeps_the_whole() -> None:
    result = await _run(_executor(), "report", '{"lines": 50}')
    assert result.ok and result.truncated
    assert result.content.startswith(result.output_text[:20])
    assert "[output truncated:" in result.content
    assert len(result.output_text) > 300 and result.output == {
        "lines": [f"line {i}" for i in range(50)]
    }


async def test_a_recorded_result_is_returned_without_running_again() -> None:
    journal = InMemoryJournal()
    executor = _executor(journal)
    first = await _run(executor, "book_flight", '{"flight": "AF1", "passengers": 1}')
    again = await _run(_executor(journal), "book_flight", '{"flight": "AF1", "passengers": 1}')
    assert first.ok and not first.replayed and first.idempotency_key
    assert again.ok and again.replayed and not again.executed
    assert again.content == first.content
    assert len(executions) == 1
    entry = journal.get(first.idempotency_key)
    assert entry is not None and entry.status == "succeeded" and entry.attempts == 1


async def test_in_doubt_follows_the_declared_policy() -> None:
    journal = InMemoryJournal()
    executor = _executor(journal)
    from keel.tools import idempotency_key

    for step, tool_name in ((1, "book_flight"), (2, "hold_seat")):
        journal.claim(
            key=idempotency_key("s1", step, 0),
            session_id="s1",
            step=step,
            call_index=0,
            tool=tool_name,
            arguments="{}",
        )
    doubt = await _run(executor, "book_flight", '{"flight": "AF1", "passengers": 1}', step=1)
    assert doubt.status == "in_doubt" and not doubt.executed
    assert isinstance(doubt.exception, ToolInDoubtError)
    assert doubt.exception.idempotency_key == idempotency_key("s1", 1, 0)
    assert "Do not call it again" in doubt.content
    rerun = await _run(executor, "hold_seat", '{"seat": "12A"}', step=2)
    assert rerun.ok and rerun.executed and rerun.attempt == 2
    assert executions == ["12A"]
    assert [entry.tool for entry in journal.in_doubt("s1")] == ["book_flight"]
    journal.resolve(idempotency_key("s1", 1, 0), ok=True, content="booked (checked by hand)")
    resolved = await _run(executor, "book_flight", '{"flight": "AF1", "passengers": 1}', step=1)
    assert resolved.replayed and resolved.content == "booked (checked by hand)"
    assert journal.in_doubt() == []


async def test_side_effect_free_tools_are_not_journalled() -> None:
    journal = InMemoryJournal()
    result = await _run(_executor(journal), "explode", '{"reason": "x"}')
    assert result.idempotency_key is None and journal.entries() == []


async def test_a_side_effect_free_tool_gets_its_context_as_a_first_start() -> None:
    seen: list[ToolContext] = []

    @tool
    def look_up(city: str, context: ToolContext) -> str:
        """Look a city up."""
        seen.append(context)
        return city

    executor = ToolExecutor(ToolRegistry([look_up]), scope=ToolScope(user_id="u1", deps="db"))
    call = ToolCall(id="call_7", name="look_up", arguments='{"city": "Oslo"}')
    result = await executor.execute(call, session_id="s1", step=3, call_index=1, turn_id="t1")
    assert result.ok and result.executed and result.attempt == 1
    [context] = seen
    assert (context.session_id, context.step, context.call_index, context.call_id) == (
        "s1",
        3,
        1,
        "call_7",
    )
    assert context.attempt == 1 and context.user_id == "u1" and context.deps == "db"
    assert context.idempotency_key == idempotency_key("s1", 3, 1, "t1")


async def test_no_journal_no_side_effect(tmp_path: Path) -> None:
    db = SQLiteDatabase(tmp_path / "keel.db")
    executor = ToolExecutor(ToolRegistry([book_flight]), journal=SQLToolJournal(db))
    db.close()  # the database goes away before the call
    result = await _run(executor, "book_flight", '{"flight": "AF1", "passengers": 1}')
    assert result.status == "failed" and not result.executed and executions == []
    assert "was not run" in result.content and result.error_type == "StoreError"


async def test_a_lost_result_record_leaves_the_call_in_doubt(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    db = SQLiteDatabase(tmp_path / "keel.db")
    journal = SQLToolJournal(db)

    @tool(side_effect=True)
    def pay(amount: int) -> str:
        """Pay."""
        db.close()  # the database goes away while the tool runs
        return f"paid {amount}"

    result = await _run(ToolExecutor(ToolRegistry([pay]), journal=journal), "pay", '{"amount": 3}')
    assert result.ok and result.content == "paid 3"
    assert "stays in doubt" in caplog.text
    reopened = SQLToolJournal(SQLiteDatabase(tmp_path / "keel.db"))
    assert [entry.tool for entry in reopened.in_doubt()] == ["pay"]
    reopened.db.close()


def _blocking_booker(effects: list[str], release: threading.Event, *, idempotent: bool) -> Tool:
    """A booking that takes effect at once, then hangs until ``release`` (a slow API reply)."""

    @tool(side_effect=True, idempotent=idempotent, timeout_s=0.05)
    def book_slowly(flight: str) -> str:
        """Book a flight (the airline answers slowly)."""
        effects.append(flight)
        release.wait(10)
        return f"booked {flight}, ref PNR1"

    return book_slowly


def _gated_like_the_agent(inner: Tool) -> Tool:
    """An async wrapper around ``ainvoke``, as the Agent's workflow gate builds one."""

    async def gated(**kwargs: Any) -> Any:
        return await inner.ainvoke(inner.args_model.model_validate(kwargs), None)

    return dataclasses.replace(inner, function=gated)


async def _settled(journal: InMemoryJournal, key: str) -> JournalEntry:
    for _ in range(200):
        entry = journal.get(key)
        assert entry is not None
        if not entry.in_doubt:
            return entry
        await asyncio.sleep(0.025)
    raise AssertionError(f"{key} never settled")


@pytest.mark.parametrize("wrapped", [False, True], ids=["plain", "gated"])
async def test_a_timed_out_booking_is_in_doubt_and_never_runs_twice(wrapped: bool) -> None:
    effects: list[str] = []
    release = threading.Event()
    booker = _blocking_booker(effects, release, idempotent=False)
    if wrapped:
        booker = _gated_like_the_agent(booker)
    journal = InMemoryJournal()
    executor = ToolExecutor(ToolRegistry([booker]), journal=journal)
    try:
        first = await _run(executor, "book_slowly", '{"flight": "KL7"}', step=1)
        assert first.status == "in_doubt" and first.executed
        assert isinstance(first.exception, ToolInDoubtError)
        assert first.idempotency_key is not None
        assert "Do not call it again" in first.content
        # The journal says the truth: started, no result (not 'failed').
        assert [e.key for e in journal.in_doubt("s1")] == [first.idempotency_key]
        # The model asks again at a later step (another key): refused, naming the first call.
        again = await _run(executor, "book_slowly", '{"flight": "KL7"}', step=2)
        assert again.status == "in_doubt" and not again.executed
        assert isinstance(again.exception, ToolInDoubtError)
        assert again.exception.idempotency_key == first.idempotency_key
        assert first.idempotency_key in again.content
        # Other arguments are another call: it runs.
        other = await _run(executor, "book_slowly", '{"flight": "AF9"}', step=3)
        assert other.status == "in_doubt" and effects == ["KL7", "AF9"]
    finally:
        release.set()
    # The abandoned thread finishes: its real result is journalled and the call is settled.
    settled = await _settled(journal, first.idempotency_key)
    assert settled.status == "succeeded" and settled.output == "booked KL7, ref PNR1"
    assert settled.content is not None and settled.content.startswith(LATE_NOTE)
    # The model never saw that result: a repeat gets it instead of booking again...
    repeat = await _run(executor, "book_slowly", '{"flight": "KL7"}', step=4)
    assert repeat.ok and repeat.replayed and not repeat.executed
    assert first.idempotency_key in repeat.content and "booked KL7, ref PNR1" in repeat.content
    assert effects == ["KL7", "AF9"]
    # ...and a resume of that step agrees with what the model was shown.
    replay = await _run(executor, "book_slowly", '{"flight": "KL7"}', step=4)
    assert replay.replayed and replay.content == repeat.content
    assert effects == ["KL7", "AF9"]
    # A second repeat gets it too: the first one's journalled answer ran nothing.
    second = await _run(executor, "book_slowly", '{"flight": "KL7"}', step=5)
    assert second.ok and second.replayed and not second.executed
    assert first.idempotency_key in second.content and "booked KL7, ref PNR1" in second.content
    assert effects == ["KL7", "AF9"]


async def test_a_timed_out_idempotent_call_may_be_retried_and_settles_later() -> None:
    effects: list[str] = []
    release = threading.Event()
    journal = InMemoryJournal()
    executor = ToolExecutor(
        ToolRegistry([_blocking_booker(effects, release, idempotent=True)]), journal=journal
    )
    first = await _run(executor, "book_slowly", '{"flight": "KL7"}', step=1)
    assert first.status == "timeout" and "safe to call it again" in first.content
    assert first.idempotency_key is not None
    assert journal.in_doubt("s1")[0].key == first.idempotency_key
    release.set()
    retry = await _run(executor, "book_slowly", '{"flight": "KL7"}', step=2)
    assert retry.ok and retry.executed and effects == ["KL7", "KL7"]
    assert (await _settled(journal, first.idempotency_key)).status == "succeeded"


async def test_an_operator_resolution_is_not_overwritten_by_the_late_result() -> None:
    effects: list[str] = []
    release = threading.Event()
    journal = InMemoryJournal()
    executor = ToolExecutor(
        ToolRegistry([_blocking_booker(effects, release, idempotent=False)]), journal=journal
    )
    first = await _run(executor, "book_slowly", '{"flight": "KL7"}', step=1)
    assert first.idempotency_key is not None
    journal.resolve(first.idempotency_key, ok=False, content="not booked (checked by hand)")
    release.set()
    for _ in range(20):
        await asyncio.sleep(0.025)
    entry = journal.get(first.idempotency_key)
    assert entry is not None and entry.content == "not booked (checked by hand)"
    # Settled as not done: a repeat is a new booking and runs.
    repeat = await _run(executor, "book_slowly", '{"flight": "KL7"}', step=2)
    assert repeat.ok and repeat.executed and effects == ["KL7", "KL7"]
