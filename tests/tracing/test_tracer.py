"""The Tracer API the runtime calls: nesting, timing, errors, redaction, failure policy."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from pydantic import BaseModel

from keel.errors import (
    LoopDetectedError,
    StepLimitError,
    TimeLimitError,
    ToolExecutionError,
    ToolInDoubtError,
)
from keel.messages import Usage
from keel.stores import SQLiteDatabase
from keel.stores._sql_traces import SQLTraceStore
from keel.tracing import Run, Step, Tracer, status_for


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SQLTraceStore]:
    with SQLiteDatabase(tmp_path / "keel.db") as database:
        store = SQLTraceStore(database)
        store.setup()
        yield store
        store.close()


class Budget(BaseModel):
    window: int
    reserve: int


def test_a_turn_is_a_tree_with_timings_and_totals(store: SQLTraceStore) -> None:
    tracer = Tracer(store, agent="booker")
    with tracer.start_run("s1", user_id="u1", tenant_id="t1", input="book it") as run:
        with run.step(
            "model", "scripted:policy", state_version=7, budget=Budget(window=8192, reserve=512)
        ) as call:
            call.first_token()
            call.update(
                usage=Usage(prompt_tokens=900, completion_tokens=40),
                raw_output='{"tool": "book"}',
                parsed_action={"tool": "book", "args": {"seat": "3A"}},
                finish_reason="tool_calls",
                model="scripted:policy",
            )
            with run.step(
                "tool", "book", tool_call_id="c1", tool_arguments='{"seat": "3A"}'
            ) as tool:
                tool.update(tool_result={"ok": True, "ref": "PNR1"})
        run.transition("booking", "done", state_version=8)
        run.end(output="booked: PNR1")
    detail = store.get_run_detail(run.run_id)
    assert detail is not None
    assert detail.run.status == "succeeded" and detail.run.output == "booked: PNR1"
    assert (detail.run.user_id, detail.run.tenant_id, detail.run.agent) == ("u1", "t1", "booker")
    assert detail.run.prompt_tokens == 900 and detail.run.step_count == 3
    model, tool, transition = detail.steps
    assert tool.parent_id == model.step_id and transition.parent_id is None
    assert model.budget == {"window": 8192, "reserve": 512} and model.state_version == 7
    assert model.parsed_action == {"tool": "book", "args": {"seat": "3A"}}
    assert model.ttft_ms is not None and model.latency_ms is not None
    assert model.ttft_ms <= model.latency_ms
    assert model.ended_at is not None and model.ended_at >= model.started_at
    assert tool.tool_result == '{"ok": true, "ref": "PNR1"}' and tool.tool_call_id == "c1"
    assert transition.name == "booking->done" and transition.attributes == {
        "source": "booking",
        "target": "done",
    }
    assert [n.step.kind for n in detail.tree()] == ["model", "transition"]


def test_an_exception_is_recorded_and_reraised(store: SQLTraceStore) -> None:
    tracer = Tracer(store)
    with pytest.raises(StepLimitError), tracer.start_run("s1") as run:
        with pytest.raises(ToolExecutionError), run.step("tool", "pay"):
            raise ToolExecutionError("card declined")
        raise StepLimitError("20 steps")
    detail = store.get_run_detail(run.run_id)
    assert detail is not None
    assert detail.run.status == "limited" and detail.run.error_type == "StepLimitError"
    (step,) = detail.steps
    assert (step.error_type, step.error_message) == ("ToolExecutionError", "card declined")
    assert detail.run.tool_errors == 1


def test_status_for_maps_errors_to_run_outcomes() -> None:
    assert status_for(None) == "succeeded"
    assert status_for(StepLimitError("x")) == "limited"
    assert status_for(TimeLimitError("x")) == "limited"
    assert status_for(LoopDetectedError("loop", evidence=["a"])) == "escalated"
    assert status_for(ToolInDoubtError("book", "k1")) == "escalated"
    assert status_for(ValueError("x")) == "failed"


def test_guard_events_resets_and_loops(store: SQLTraceStore) -> None:
    tracer = Tracer(store)
    with tracer.start_run("s1") as run:
        run.guard("truncation", "finish_reason=length")
        run.loop_caught(["search x3 same args"], escalated=True)
        run.state_reset("3 failures in state 'payment'")
        run.record("tool", "search", attempt=2, latency_ms=12.0)
        run.end("escalated")
    steps = store.get_steps(run.run_id)
    assert [(s.kind, s.name) for s in steps] == [
        ("guard", "truncation"),
        ("guard", "loop"),
        ("reset", "reset"),
        ("tool", "search"),
    ]
    assert steps[1].attributes == {"evidence": ["search x3 same args"], "escalated": True}
    assert steps[3].latency_ms == 12.0 and steps[3].attempt == 2
    (stats,) = store.session_stats()
    assert (stats.loops_caught, stats.state_resets, stats.retries) == (1, 1, 1)
    run_row = store.get_run(run.run_id)
    assert run_row is not None and run_row.status == "escalated"


def test_ending_twice_keeps_the_first_outcome(store: SQLTraceStore) -> None:
    tracer = Tracer(store)
    with tracer.start_run("s1") as run:
        run.end("failed", error=RuntimeError("first"))
    run.end("succeeded")
    stored = store.get_run(run.run_id)
    assert stored is not None and stored.status == "failed" and stored.error_message == "first"


def test_explicit_parents_and_manual_end(store: SQLTraceStore) -> None:
    tracer = Tracer(store)
    run = tracer.start_run("s1")
    call = run.step("model", "m")
    tool = run.step("tool", "t", parent=call)
    top = run.step("memory", "write", parent=None)
    assert tool.end(tool_result="ok") is not None
    assert tool.end() is None  # a second end is ignored
    call.end()
    top.end()
    run.end()
    steps = {s.name: s for s in store.get_steps(run.run_id)}
    assert steps["t"].parent_id == steps["m"].step_id and steps["write"].parent_id is None
    assert [s.name for s in store.get_steps(run.run_id)] == ["m", "t", "write"]


async def test_async_steps_nest_per_task(store: SQLTraceStore) -> None:
    tracer = Tracer(store)
    run = await tracer.astart_run("s1")

    async def tool_call(name: str) -> None:
        async with run.step("tool", name) as step:
            await asyncio.sleep(0.01)
            await run.arecord("guard", f"checked-{name}")
            step.update(tool_result=name)

    async with run.step("model", "m") as call:
        await asyncio.gather(tool_call("a"), tool_call("b"))
    await run.aend(output="done")
    steps = {s.name: s for s in store.get_steps(run.run_id)}
    assert steps["a"].parent_id == call.step_id and steps["b"].parent_id == call.step_id
    assert steps["checked-a"].parent_id == steps["a"].step_id
    assert steps["checked-b"].parent_id == steps["b"].step_id
    assert steps["a"].latency_ms is not None and steps["a"].latency_ms >= 10
    stored = await store.aget_run(run.run_id)
    assert stored is not None and stored.status == "succeeded" and stored.step_count == 5


def test_a_failing_store_never_breaks_the_agent(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    db = SQLiteDatabase(tmp_path / "keel.db")
    store = SQLTraceStore(db)
    store.setup()
    db.close()  # every write from now on raises StoreError inside the store
    tracer = Tracer(store)
    with caplog.at_level(logging.WARNING, logger="keel.tracing"):
        with tracer.start_run("s1") as run:
            with run.step("model", "m") as call:
                call.update(prompt_tokens=5)
            run.record("guard", "g")
        result = "the agent carried on"
    assert result == "the agent carried on"
    assert tracer.write_failures == 4  # run start, two steps, run end
    assert tracer.last_error is not None and "closed" in str(tracer.last_error)
    warnings = [r for r in caplog.records if r.name == "keel.tracing"]
    assert len(warnings) == 4 and all(r.levelno == logging.WARNING for r in warnings)


async def test_a_failing_store_never_breaks_an_async_agent(tmp_path: Path) -> None:
    db = SQLiteDatabase(tmp_path / "keel.db")
    store = SQLTraceStore(db)
    store.setup()
    db.close()
    tracer = Tracer(store)
    run = await tracer.astart_run("s1")
    async with run.step("model", "m"):
        pass
    await run.aend()
    assert tracer.write_failures == 3


def test_a_bad_field_or_a_crashing_redactor_is_counted_not_raised(
    store: SQLTraceStore,
) -> None:
    def broken(text: str) -> str:
        raise RuntimeError("redactor bug")

    tracer = Tracer(store, redact=broken)
    run = tracer.start_run("s1", input="hello")
    run.record("tool", "t", tool_result="x")
    run.end()
    assert tracer.write_failures >= 2
    ok = Tracer(store)
    with ok.start_run("s2") as run2:
        run2.record("model", "m", prompt_tokens=-5)  # invalid: negative tokens
    assert ok.write_failures == 1
    stored = store.get_run(run2.run_id)
    assert stored is not None and stored.step_count == 0 and stored.status == "succeeded"


def test_redaction_can_be_turned_off_explicitly(store: SQLTraceStore) -> None:
    tracer = Tracer(store, redact=None)
    with tracer.start_run("s1", input="me@example.com") as run:
        pass
    stored = store.get_run(run.run_id)
    assert stored is not None and stored.input == "me@example.com"


def test_a_custom_redactor_sees_every_text_field(store: SQLTraceStore) -> None:
    tracer = Tracer(store, redact=lambda text: text.replace("Alice", "[NAME]"))
    with tracer.start_run("s1", input="Alice here", attributes={"who": ["Alice"]}) as run:
        run.record(
            "tool",
            "lookup",
            tool_arguments={"name": "Alice"},
            tool_result="Alice's order",
            raw_output="Alice",
            parsed_action={"say": "hi Alice"},
            budget={"note": "Alice"},
            error_message="no Alice",
            attributes={"deep": {"x": ["Alice"]}},
        )
        run.end(output="bye Alice")
    detail = store.get_run_detail(run.run_id)
    assert detail is not None
    assert "Alice" not in detail.model_dump_json()
    assert detail.run.input == "[NAME] here"


class Recorder:
    def __init__(self) -> None:
        self.exported: list[tuple[Run, Sequence[Step]]] = []

    def export(self, run: Run, steps: Sequence[Step]) -> None:
        self.exported.append((run, steps))


class Exploding:
    def export(self, run: Run, steps: Sequence[Step]) -> None:
        raise RuntimeError("collector down")


def test_exporters_get_finished_runs_and_cannot_break_the_agent() -> None:
    recorder = Recorder()
    tracer = Tracer(None, exporters=[Exploding(), recorder])
    with tracer.start_run("s1") as run:
        with run.step("model", "m", usage=Usage(prompt_tokens=3, completion_tokens=1)):
            pass
        run.record("tool", "t", error=ToolExecutionError("x"))
    ((exported_run, steps),) = recorder.exported
    assert exported_run.status == "succeeded" and exported_run.ended_at is not None
    assert exported_run.step_count == 2 and exported_run.tool_errors == 1
    assert exported_run.prompt_tokens == 3
    assert [s.kind for s in steps] == ["model", "tool"]
    assert tracer.write_failures == 1 and "collector down" in str(tracer.last_error)


def test_a_run_resumes_after_a_crash(store: SQLTraceStore) -> None:
    first = Tracer(store)
    run = first.start_run("s1", input="book it")
    run.record("model", "m", prompt_tokens=10)
    run.record("tool", "book", tool_call_id="c1")
    # The worker dies here: the run stays "running" with its two steps.
    crashed = store.get_run(run.run_id)
    assert crashed is not None and crashed.status == "running" and crashed.step_count == 2

    second = Tracer(store)
    resumed = second.resume_run(run.run_id)
    assert resumed is not None and resumed.session_id == "s1"
    resumed.record("checkpoint", "resumed")
    resumed.record("model", "m", prompt_tokens=12)
    resumed.end(output="booked")
    detail = store.get_run_detail(run.run_id)
    assert detail is not None
    assert [s.seq for s in detail.steps] == [0, 1, 2, 3]
    assert [s.name for s in detail.steps] == ["m", "book", "resumed", "m"]
    assert detail.run.status == "succeeded" and detail.run.prompt_tokens == 22
    assert detail.run.input == "book it" and detail.run.started_at == crashed.started_at
    assert second.resume_run("no-such-run") is None and second.write_failures == 1


async def test_a_run_resumes_async(store: SQLTraceStore) -> None:
    run = await Tracer(store).astart_run("s1")
    await run.arecord("model", "m")
    resumed = await Tracer(store).aresume_run(run.run_id)
    assert resumed is not None
    await resumed.arecord("model", "m2")
    await resumed.aend()
    assert [s.seq for s in store.get_steps(run.run_id)] == [0, 1]


async def test_a_scripted_model_loop_traced_from_completions(store: SQLTraceStore) -> None:
    from keel.messages import Message
    from keel.testing import ScriptedModel

    model = ScriptedModel(
        [
            ScriptedModel.tool_call("find_order", '{"order_id": "A1", "email": "bo@example.com"}'),
            "Your order A1 ships tomorrow.",
        ]
    )
    tracer = Tracer(store, agent="support")
    messages = [Message.user("where is A1? I'm bo@example.com")]
    async with await tracer.astart_run("s1", input=messages[0].content) as run:
        for _ in range(3):
            async with run.step("model", model.spec, state_version=1) as call:
                completion = await model.acomplete(messages)
                call.update(completion=completion)
            messages.append(completion.message)
            if not completion.message.tool_calls:
                break
            for tool_call in completion.message.tool_calls:
                async with run.step(
                    "tool",
                    tool_call.name,
                    parent=call,
                    tool_call_id=tool_call.id,
                    tool_arguments=tool_call.arguments,
                ) as tool:
                    tool.update(tool_result="shipped")
                messages.append(Message.tool(tool_call.id, "shipped"))
        await run.aend(output=completion.message.content)
    detail = store.get_run_detail(run.run_id)
    assert detail is not None
    first, tool_step, second = detail.steps
    assert first.finish_reason == "tool_calls" and second.finish_reason == "stop"
    assert first.model == "scripted:gpt-4o-mini" and first.ttft_ms is not None
    assert second.prompt_tokens == completion.usage.prompt_tokens > first.prompt_tokens > 0
    assert first.raw_output is not None and '"find_order"' in first.raw_output
    assert "bo@example.com" not in (first.raw_output or "") + (tool_step.tool_arguments or "")
    assert tool_step.parent_id == first.step_id and tool_step.tool_call_id is not None
    assert second.raw_output == "Your order A1 ships tomorrow."
    assert detail.run.output == "Your order A1 ships tomorrow."
    assert detail.run.model_calls == 2 and detail.run.tool_calls == 1
    assert detail.run.prompt_tokens == first.prompt_tokens + second.prompt_tokens > 0


def test_a_failed_run_start_is_retried_with_the_next_write(tmp_path: Path) -> None:
    import sqlite3

    db = SQLiteDatabase(tmp_path / "keel.db", busy_timeout_ms=50)
    store = SQLTraceStore(db)
    store.setup()
    blocker = sqlite3.connect(tmp_path / "keel.db", isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")  # another writer holds the lock
    tracer = Tracer(store)
    run = tracer.start_run("s1", input="hello")
    assert tracer.write_failures == 1  # the header could not be written
    blocker.execute("ROLLBACK")
    blocker.close()
    run.record("model", "m", prompt_tokens=3)
    run.end(output="bye")
    stored = store.get_run(run.run_id)
    assert stored is not None and stored.input == "hello" and stored.output == "bye"
    assert stored.step_count == 1 and tracer.write_failures == 1
    store.close()
    db.close()


async def test_a_buffered_run_writes_at_its_flushes_and_its_end(store: SQLTraceStore) -> None:
    tracer = Tracer(store, agent="booker")
    run = await tracer.astart_run("s1", input="hello", buffered=True)
    await run.arecord("model", "gpt", usage=Usage(prompt_tokens=10, completion_tokens=2))
    assert store.get_run(run.run_id) is None, "a buffered run wrote before its flush"
    commits: list[str] = []
    connection = store.db.connection

    def traced() -> sqlite3.Connection:
        conn = connection()
        conn.set_trace_callback(lambda sql: commits.append(sql) if sql == "COMMIT" else None)
        return conn

    store.db.connection = traced  # type: ignore[method-assign]
    await run.aflush()
    await run.aflush()  # nothing new: nothing written
    store.db.connection = connection  # type: ignore[method-assign]
    assert commits == ["COMMIT"], "the header and the step were not one batch"
    stored = store.get_run(run.run_id)
    assert stored is not None and stored.status == "running" and stored.step_count == 1
    await run.arecord("tool", "lookup", tool_name="lookup", tool_result="ok")
    await run.aend(output="bye")
    stored = store.get_run(run.run_id)
    assert stored is not None
    assert (stored.status, stored.output, stored.step_count) == ("succeeded", "bye", 2)
    assert [step.kind for step in store.get_steps(run.run_id)] == ["model", "tool"]


async def test_a_buffered_run_ended_through_the_sync_twin_keeps_its_buffered_steps(
    store: SQLTraceStore,
) -> None:
    tracer = Tracer(store)
    run = await tracer.astart_run("s1", input="hello", buffered=True)
    await run.arecord("model", "gpt")
    run.flush()
    await run.arecord("tool", "lookup", tool_name="lookup", tool_result="ok")
    run.end(output="bye")
    stored = store.get_run(run.run_id)
    assert stored is not None
    assert (stored.status, stored.output, stored.step_count) == ("succeeded", "bye", 2)
    assert [step.kind for step in store.get_steps(run.run_id)] == ["model", "tool"]


async def test_a_loop_step_becomes_a_model_step_with_its_tools_guards_and_moves_under_it(
    store: SQLTraceStore,
) -> None:
    from dataclasses import dataclass, field

    from keel.tracing import arecord_loop_step

    @dataclass
    class Outcome:
        tool: str = "lookup"
        call_id: str = "c1"
        raw_arguments: str = '{"q": "x"}'
        ok: bool = True
        output_text: str = "found it"
        error_type: str | None = None
        error: str | None = None
        latency_ms: float = 2.0
        repairs: tuple[str, ...] = ()
        replayed: bool = False
        truncated: bool = False

    @dataclass
    class LoopStepRecord:
        step: int = 3
        action: str = "tool_calls"
        model: str = ""
        usage: Usage = field(default_factory=lambda: Usage(prompt_tokens=40, completion_tokens=5))
        finish_reason: str | None = "tool_calls"
        raw_output: str | None = "{}"
        replayed_decision: bool = False
        tool_results: tuple[Outcome, ...] = (Outcome(),)
        guard_events: tuple[str, ...] = ("loop: the same call twice",)
        error: str | None = None
        error_type: str | None = None
        model_latency_ms: float | None = 10.0
        ttft_ms: float | None = None

    tracer = Tracer(store, agent="booker")
    run = await tracer.astart_run("s1")
    await arecord_loop_step(
        run, LoopStepRecord(), model="gpt-4o-mini", state_version=7, transitions=[("a", "b")]
    )
    await run.aend()
    steps = store.get_steps(run.run_id)
    model = steps[0]
    assert (model.kind, model.name, model.state_version, model.prompt_tokens) == (
        "model",
        "gpt-4o-mini",
        7,
        40,
    )
    children = [(s.kind, s.name) for s in steps[1:] if s.parent_id == model.step_id]
    assert children == [("tool", "lookup"), ("guard", "loop"), ("transition", "a->b")]
    assert steps[1].tool_result == "found it"
