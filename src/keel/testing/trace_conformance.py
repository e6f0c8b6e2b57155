"""The conformance suite every [`TraceStore`][] backend must pass.

Subclass `TraceStoreConformance` in a test module and supply only the factory, as a
pytest fixture named ``trace_store`` that yields a fresh, empty store (``setup()`` done):

```python
class TestMyTraces(TraceStoreConformance):
    @pytest.fixture
    def trace_store(self, tmp_path):
        store = MyTraceStore(tmp_path / "traces")
        store.setup()
        yield store
        store.close()
```
"""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any

from keel.errors import StoreError, UsageError
from keel.messages import Usage
from keel.tracing._models import Run, RunQuery, Step, StepKind
from keel.tracing._store import RunEnding, TraceStore
from keel.tracing._tracer import Tracer

__all__ = ["TraceStoreConformance"]

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def _run(run_id: str, session: str = "s1", *, minutes: int = 0, **extra: Any) -> Run:
    return Run(
        run_id=run_id,
        session_id=session,
        agent=extra.pop("agent", "booker"),
        started_at=T0 + timedelta(minutes=minutes),
        **extra,
    )


def _step(
    run_id: str, seq: int, kind: StepKind = "model", *, seconds: float | None = None, **extra: Any
) -> Step:
    start = T0 + timedelta(seconds=seq if seconds is None else seconds)
    return Step(
        run_id=run_id,
        step_id=extra.pop("step_id", f"{run_id}-{seq}"),
        seq=seq,
        kind=kind,
        name=extra.pop("name", kind),
        started_at=start,
        ended_at=start + timedelta(milliseconds=250),
        **extra,
    )


class TraceStoreConformance:
    """Behaviour every trace backend shares. Test methods take the ``trace_store`` fixture."""

    # --- runs -----------------------------------------------------------------------------

    def test_setup_is_idempotent(self, trace_store: TraceStore) -> None:
        trace_store.setup()
        trace_store.setup()
        trace_store.start_run(_run("r1"))
        trace_store.setup()
        assert trace_store.get_run("r1") is not None

    def test_run_round_trips(self, trace_store: TraceStore) -> None:
        run = _run(
            "r1",
            user_id="u1",
            tenant_id="t1",
            input="héllo ✈",
            attributes={"channel": "web", "nested": {"k": [1, 2]}},
        )
        trace_store.start_run(run)
        assert trace_store.get_run("r1") == run
        assert trace_store.get_run("missing") is None

    def test_end_run_sets_outcome(self, trace_store: TraceStore) -> None:
        trace_store.start_run(_run("r1"))
        ended = T0 + timedelta(seconds=3)
        trace_store.end_run(
            "r1",
            status="limited",
            ended_at=ended,
            output="sorry",
            error_type="StepLimitError",
            error_message="12 steps",
        )
        run = trace_store.get_run("r1")
        assert run is not None
        assert (run.status, run.ended_at, run.output) == ("limited", ended, "sorry")
        assert (run.error_type, run.error_message) == ("StepLimitError", "12 steps")
        assert run.duration_ms == 3000

    def test_ending_an_unknown_run_is_a_store_error(self, trace_store: TraceStore) -> None:
        try:
            trace_store.end_run("nope", status="failed", ended_at=T0)
        except StoreError:
            return
        raise AssertionError("end_run of an unknown run did not raise StoreError")

    def test_restarting_a_run_keeps_its_steps(self, trace_store: TraceStore) -> None:
        trace_store.start_run(_run("r1"))
        trace_store.write_step(_step("r1", 0, prompt_tokens=10))
        trace_store.start_run(_run("r1", input="again"))
        run = trace_store.get_run("r1")
        assert run is not None and run.input == "again" and run.step_count == 1
        assert len(trace_store.get_steps("r1")) == 1

    def test_a_batch_starts_writes_and_ends_a_run(self, trace_store: TraceStore) -> None:
        ended = T0 + timedelta(seconds=5)
        trace_store.write_batch(
            run=_run("r1"),
            steps=[_step("r1", 0, prompt_tokens=10), _step("r1", 1, "tool")],
            end=None,
        )
        run = trace_store.get_run("r1")
        assert run is not None and run.status == "running"
        assert (run.step_count, run.model_calls, run.tool_calls) == (2, 1, 1)
        trace_store.write_batch(
            run=None,
            steps=[_step("r1", 2, prompt_tokens=5)],
            end=RunEnding("r1", "succeeded", ended, "done"),
        )
        run = trace_store.get_run("r1")
        assert run is not None
        assert (run.status, run.ended_at, run.output) == ("succeeded", ended, "done")
        assert (run.step_count, run.prompt_tokens) == (3, 15)
        assert [step.seq for step in trace_store.get_steps("r1")] == [0, 1, 2]

    def test_a_batch_ending_an_unknown_run_fails(self, trace_store: TraceStore) -> None:
        try:
            trace_store.write_batch(run=None, steps=[], end=RunEnding("nope", "failed", T0))
        except StoreError:
            return
        raise AssertionError("a batch ending an unknown run did not raise StoreError")

    def test_a_batch_of_steps_of_an_unknown_run_fails_whole(self, trace_store: TraceStore) -> None:
        trace_store.start_run(_run("r1"))
        try:
            trace_store.write_batch(
                run=None,
                steps=[_step("r1", 0), _step("ghost", 0)],
                end=RunEnding("ghost", "failed", T0),
            )
        except StoreError as exc:
            assert "ghost" in str(exc), exc  # the error names the missing run
        else:
            raise AssertionError("a batch of steps of an unknown run did not raise StoreError")
        run = trace_store.get_run("r1")
        assert run is not None and run.step_count == 0 and trace_store.get_steps("r1") == []

    def test_a_batch_ends_another_run_than_its_steps(self, trace_store: TraceStore) -> None:
        trace_store.start_run(_run("r1"))
        trace_store.start_run(_run("r2"))
        trace_store.write_batch(
            run=None,
            steps=[_step("r1", 0, prompt_tokens=7), _step("r2", 0, "tool")],
            end=RunEnding("r2", "failed", T0, error_type="E", error_message="boom"),
        )
        first, second = trace_store.get_run("r1"), trace_store.get_run("r2")
        assert first is not None and second is not None
        assert (first.status, first.step_count, first.prompt_tokens) == ("running", 1, 7)
        assert (second.status, second.error_message, second.tool_calls) == ("failed", "boom", 1)

    # --- steps ----------------------------------------------------------------------------

    def test_every_step_field_round_trips_whole(self, trace_store: TraceStore) -> None:
        trace_store.start_run(_run("r1"))
        big = "x" * 300_000 + " end ✓"
        step = _step(
            "r1",
            0,
            "tool",
            name="search_flights",
            parent_id="r1-parent",
            latency_ms=12.5,
            ttft_ms=3.25,
            attempt=2,
            prompt_tokens=7,
            completion_tokens=3,
            model="openai:gpt-4o-mini",
            finish_reason="tool_calls",
            budget={"window": 8192, "sections": {"history": 1200, "memory": [1, 2]}},
            state_version=41,
            raw_output=big,
            parsed_action=["call", {"tool": "search_flights"}],
            tool_name="search_flights",
            tool_call_id="call_1",
            tool_arguments='{"from": "LIS", "to": "OSL"',
            tool_result=big,
            error_type="ToolExecutionError",
            error_message="boom",
            attributes={"repaired": True, "fields": ["passengers"]},
        )
        trace_store.write_step(step)
        (stored,) = trace_store.get_steps("r1")
        assert stored == step
        assert stored.raw_output == big and stored.tool_result == big

    def test_minimal_step_round_trips(self, trace_store: TraceStore) -> None:
        trace_store.start_run(_run("r1"))
        step = Step(run_id="r1", step_id="a", seq=0, kind="checkpoint", started_at=T0)
        trace_store.write_step(step)
        assert trace_store.get_steps("r1") == [step]

    def test_steps_come_back_in_start_order_as_a_tree(self, trace_store: TraceStore) -> None:
        trace_store.start_run(_run("r1"))
        # Written in end order (children before parents), read in start order.
        trace_store.write_step(_step("r1", 1, "tool", step_id="t1", parent_id="m1"))
        trace_store.write_step(_step("r1", 2, "tool", step_id="t2", parent_id="m1"))
        trace_store.write_step(_step("r1", 0, "model", step_id="m1"))
        trace_store.write_step(_step("r1", 3, "transition", step_id="x1"))
        detail = trace_store.get_run_detail("r1")
        assert detail is not None
        assert [s.step_id for s in detail.steps] == ["m1", "t1", "t2", "x1"]
        tree = detail.tree()
        assert [n.step.step_id for n in tree] == ["m1", "x1"]
        assert [n.step.step_id for n in tree[0].children] == ["t1", "t2"]
        assert trace_store.get_run_detail("missing") is None

    def test_totals_are_exact_even_when_a_step_is_rewritten(self, trace_store: TraceStore) -> None:
        trace_store.start_run(_run("r1"))
        trace_store.write_step(_step("r1", 0, "model", prompt_tokens=100, completion_tokens=20))
        trace_store.write_step(_step("r1", 1, "tool"))
        trace_store.write_step(_step("r1", 2, "tool", error_type="ToolExecutionError"))
        trace_store.write_step(_step("r1", 3, "guard"))
        # Rewriting the failed tool step as a success and the model step with new usage.
        trace_store.write_step(_step("r1", 2, "tool"))
        trace_store.write_step(_step("r1", 0, "model", prompt_tokens=150, completion_tokens=30))
        run = trace_store.get_run("r1")
        assert run is not None
        assert (run.step_count, run.model_calls, run.tool_calls, run.tool_errors) == (4, 1, 2, 0)
        assert (run.prompt_tokens, run.completion_tokens) == (150, 30)

    def test_totals_are_exact_when_a_batch_rewrites_steps(self, trace_store: TraceStore) -> None:
        trace_store.start_run(_run("r1"))
        trace_store.write_step(_step("r1", 0, "model", prompt_tokens=100))
        # One batch: a stored step rewritten, a new step written twice (failed, then not).
        trace_store.write_batch(
            run=None,
            steps=[
                _step("r1", 0, "model", prompt_tokens=40),
                _step("r1", 1, "tool", error_type="ToolExecutionError"),
                _step("r1", 1, "tool"),
            ],
            end=None,
        )
        run = trace_store.get_run("r1")
        assert run is not None
        assert (run.step_count, run.model_calls, run.tool_calls, run.tool_errors) == (2, 1, 1, 0)
        assert run.prompt_tokens == 40
        assert [s.error_type for s in trace_store.get_steps("r1")] == [None, None]

    def test_a_step_of_an_unknown_run_is_a_store_error(self, trace_store: TraceStore) -> None:
        try:
            trace_store.write_step(_step("ghost", 0))
        except StoreError:
            return
        raise AssertionError("write_step for an unknown run did not raise StoreError")

    # --- queries --------------------------------------------------------------------------

    def _fill(self, store: TraceStore) -> None:
        store.start_run(_run("long", "s1", minutes=0, user_id="u1", tenant_id="t1"))
        for seq in range(12):
            store.write_step(_step("long", seq, "model" if seq % 2 == 0 else "tool"))
        store.end_run("long", status="succeeded", ended_at=T0 + timedelta(minutes=1))
        store.start_run(_run("broken", "s1", minutes=10, user_id="u1", tenant_id="t1"))
        store.write_step(_step("broken", 0, "model"))
        store.write_step(_step("broken", 1, "tool", error_type="ToolExecutionError"))
        store.end_run("broken", status="failed", ended_at=T0 + timedelta(minutes=11))
        store.start_run(_run("other", "s2", minutes=20, user_id="u2", tenant_id="t2", agent="x"))
        store.write_step(_step("other", 0, "model"))

    def test_list_runs_filters(self, trace_store: TraceStore) -> None:
        self._fill(trace_store)

        def ids(**filters: Any) -> list[str]:
            return [run.run_id for run in trace_store.list_runs(RunQuery(**filters))]

        assert ids() == ["other", "broken", "long"]
        assert trace_store.list_runs() == trace_store.list_runs(RunQuery())
        assert ids(session_id="s1") == ["broken", "long"]
        assert ids(min_steps=10) == ["long"]
        assert ids(min_steps=2) == ["broken", "long"]
        assert ids(min_steps=1) == ["other", "broken", "long"]  # "other" is still running
        assert ids(tool_error=True) == ["broken"]
        assert ids(tool_error=False) == ["other", "long"]
        assert ids(status="running") == ["other"]
        assert ids(status="failed") == ["broken"]
        assert ids(since=T0 + timedelta(minutes=10)) == ["other", "broken"]
        assert ids(until=T0 + timedelta(minutes=10)) == ["long"]
        assert ids(user_id="u2") == ["other"]
        assert ids(tenant_id="t1", session_id="s1", status="succeeded") == ["long"]
        assert ids(agent="x") == ["other"]
        assert ids(limit=1) == ["other"]
        assert ids(session_id="nobody") == []

    def test_min_model_calls_counts_model_steps_only(self, trace_store: TraceStore) -> None:
        self._fill(trace_store)

        def ids(**filters: Any) -> list[str]:
            return [run.run_id for run in trace_store.list_runs(RunQuery(**filters))]

        assert ids(min_model_calls=6) == ["long"]  # 6 model + 6 tool steps
        assert ids(min_model_calls=7) == []
        assert ids(min_model_calls=1) == ["other", "broken", "long"]

    def test_a_run_silent_past_its_time_limit_reads_as_abandoned(
        self, trace_store: TraceStore
    ) -> None:
        # abandon_after_s(0.5) is 1 s: a run still "running" that long after its last write
        # cannot be alive (a run ends within its time limit); its worker died.
        trace_store.start_run(_run("dead", minutes=1, time_limit_s=0.5))
        trace_store.start_run(_run("alive", minutes=2, time_limit_s=600))
        trace_store.start_run(_run("done", minutes=3, time_limit_s=0.5))
        trace_store.end_run("done", status="succeeded", ended_at=T0 + timedelta(minutes=4))
        time.sleep(1.3)

        def status(run_id: str) -> str:
            run = trace_store.get_run(run_id)
            assert run is not None
            return run.status

        assert (status("dead"), status("alive"), status("done")) == (
            "abandoned",
            "running",
            "succeeded",
        )
        listed = {run.run_id: run.status for run in trace_store.list_runs()}
        assert listed == {"dead": "abandoned", "alive": "running", "done": "succeeded"}
        assert [r.run_id for r in trace_store.list_runs(RunQuery(status="abandoned"))] == ["dead"]
        assert [r.run_id for r in trace_store.list_runs(RunQuery(status="running"))] == ["alive"]
        detail = trace_store.get_run_detail("dead")
        assert detail is not None and detail.run.status == "abandoned"
        (stats,) = trace_store.session_stats()  # no steps yet, yet the session is reported
        assert stats.abandoned_runs == 1 and any("abandoned" in w for w in stats.warnings)
        # A sign of life (a step written, or the run resumed) makes it running again.
        trace_store.write_step(_step("dead", 0))
        assert status("dead") == "running"
        time.sleep(1.3)
        assert status("dead") == "abandoned"
        resumed = Tracer(trace_store).resume_run("dead")
        assert resumed is not None and status("dead") == "running"
        assert trace_store.get_run("dead").time_limit_s == 0.5  # type: ignore[union-attr]

    def test_tenants_never_see_each_other(self, trace_store: TraceStore) -> None:
        self._fill(trace_store)
        assert {r.tenant_id for r in trace_store.list_runs(RunQuery(tenant_id="t2"))} == {"t2"}
        stats = trace_store.session_stats(tenant_id="t2")
        assert [s.session_id for s in stats] == ["s2"]

    def test_session_stats_indicators(self, trace_store: TraceStore) -> None:
        trace_store.start_run(_run("r1", "spiral"))
        seq = 0
        for index in range(8):
            prompt = 1000 + index * 400  # creeping up
            trace_store.write_step(
                _step(
                    "r1",
                    seq,
                    "model",
                    prompt_tokens=prompt,
                    ttft_ms=100.0 * (index + 1),
                    attempt=2 if index in (5, 6) else 1,  # retries climbing
                )
            )
            seq += 1
        trace_store.write_step(_step("r1", seq, "tool", error_type="ToolArgumentsError"))
        trace_store.write_step(_step("r1", seq + 1, "tool", attempt=2))
        trace_store.write_step(_step("r1", seq + 2, "guard", name="loop"))
        trace_store.write_step(_step("r1", seq + 3, "guard", name="truncation"))
        trace_store.write_step(_step("r1", seq + 4, "reset", name="reset"))
        trace_store.start_run(_run("r2", "calm", minutes=5))
        for index in range(6):
            trace_store.write_step(_step("r2", index, "model", prompt_tokens=500, ttft_ms=50.0))

        stats = {s.session_id: s for s in trace_store.session_stats()}
        spiral = stats["spiral"]
        assert (spiral.model_calls, spiral.tool_calls, spiral.tool_errors) == (8, 2, 1)
        assert spiral.retries == 3 and spiral.retry_rate == 0.3
        assert spiral.avg_prompt_tokens == 2400
        assert spiral.prompt_tokens_slope == 400
        assert spiral.prompt_creeping and spiral.prompt_growth > 1.5
        assert spiral.state_resets == 1 and spiral.loops_caught == 1
        assert spiral.ttft_p50_ms == 450 and spiral.ttft_p95_ms == 765
        assert len(spiral.warnings) == 4  # retry rate, prompt creep, resets, loops
        calm = stats["calm"]
        assert calm.warnings == () and not calm.prompt_creeping
        assert calm.prompt_growth == 1.0 and calm.retry_rate == 0.0
        only = trace_store.session_stats(session_id="calm")
        assert [s.session_id for s in only] == ["calm"]
        later = trace_store.session_stats(since=T0 + timedelta(minutes=1))
        assert [s.session_id for s in later] == ["calm"]

    def test_run_ids_resolve_from_unique_prefixes(self, trace_store: TraceStore) -> None:
        for run_id in ("abc123", "abd456", "x_y%z"):
            trace_store.start_run(_run(run_id))
        assert trace_store.run_ids_starting_with("ab") == ["abc123", "abd456"]
        assert trace_store.run_ids_starting_with("x_") == ["x_y%z"]
        assert trace_store.run_ids_starting_with("x%") == []
        assert trace_store.resolve_run_id("abc") == "abc123"
        assert trace_store.resolve_run_id("abd456") == "abd456"
        assert trace_store.resolve_run_id("zzz") is None
        try:
            trace_store.resolve_run_id("ab")
        except UsageError as exc:
            assert "ambiguous" in str(exc)
        else:
            raise AssertionError("an ambiguous prefix did not raise UsageError")

    def test_delete_runs_removes_their_steps(self, trace_store: TraceStore) -> None:
        self._fill(trace_store)
        assert trace_store.delete_runs(before=T0 + timedelta(minutes=15)) == 2
        assert [r.run_id for r in trace_store.list_runs()] == ["other"]
        assert trace_store.get_steps("long") == []
        assert {m.run_id for m in trace_store.step_metrics()} == {"other"}

    # --- async twins and the tracer over this backend -------------------------------------

    async def test_async_twins(self, trace_store: TraceStore) -> None:
        await trace_store.asetup()
        await trace_store.astart_run(_run("r1"))
        await trace_store.awrite_step(_step("r1", 0, prompt_tokens=5))
        await trace_store.aend_run("r1", status="succeeded", ended_at=T0 + timedelta(seconds=1))
        run = await trace_store.aget_run("r1")
        assert run is not None and run.status == "succeeded" and run.prompt_tokens == 5
        detail = await trace_store.aget_run_detail("r1")
        assert detail is not None and len(detail.steps) == 1
        assert [r.run_id for r in await trace_store.alist_runs(RunQuery(min_steps=1))] == ["r1"]
        stats = await trace_store.asession_stats(session_id="s1")
        assert stats[0].model_calls == 1

    async def test_an_async_batch_starts_rewrites_and_ends_a_run(
        self, trace_store: TraceStore
    ) -> None:
        ended = T0 + timedelta(seconds=5)
        await trace_store.awrite_batch(
            run=_run("r1"),
            steps=[_step("r1", 0, prompt_tokens=10), _step("r1", 1, "tool")],
            end=None,
        )
        # Step 0 written again with other figures: the totals are the steps', not a sum.
        await trace_store.awrite_batch(
            run=None,
            steps=[_step("r1", 0, prompt_tokens=4), _step("r1", 2, prompt_tokens=5)],
            end=RunEnding("r1", "succeeded", ended, "done"),
        )
        run = trace_store.get_run("r1")
        assert run is not None
        assert (run.status, run.ended_at, run.output) == ("succeeded", ended, "done")
        assert (run.step_count, run.model_calls, run.tool_calls, run.prompt_tokens) == (3, 2, 1, 9)
        assert [step.seq for step in trace_store.get_steps("r1")] == [0, 1, 2]

    async def test_async_writes_for_an_unknown_run_are_store_errors(
        self, trace_store: TraceStore
    ) -> None:
        trace_store.start_run(_run("r1"))
        writes = {
            "awrite_step": trace_store.awrite_step(_step("ghost", 0)),
            "aend_run": trace_store.aend_run("ghost", status="failed", ended_at=T0),
            "awrite_batch": trace_store.awrite_batch(
                run=None, steps=[_step("r1", 0), _step("ghost", 0)], end=None
            ),
        }
        for name, write in writes.items():
            try:
                await write
            except StoreError:
                continue
            raise AssertionError(f"{name} for an unknown run did not raise StoreError")
        # A failed batch is rolled back whole: r1's step in it was not written either.
        assert trace_store.get_steps("r1") == []

    async def test_tracer_writes_redacted_runs(self, trace_store: TraceStore) -> None:
        tracer = Tracer(trace_store)
        secret = "sk-proj-ABCDEFGHIJKLMNOPQRSTUV123456"
        run = await tracer.astart_run("s9", input=f"my key is {secret}")
        async with run, run.step("model", "scripted:policy") as call:
            call.update(usage=Usage(prompt_tokens=30, completion_tokens=4))
            call.update(raw_output=f"mail me at ann@example.com, key {secret}")
            async with run.step("tool", "lookup", tool_arguments={"token": secret}) as tool:
                tool.update(tool_result={"owner": "ann@example.com"})
        assert tracer.write_failures == 0
        detail = trace_store.get_run_detail(run.run_id)
        assert detail is not None and detail.run.status == "succeeded"
        assert detail.run.prompt_tokens == 30 and detail.run.step_count == 2
        dumped = detail.model_dump_json()
        assert secret not in dumped and "ann@example.com" not in dumped
        tree = detail.tree()
        assert tree[0].step.kind == "model" and tree[0].children[0].step.kind == "tool"

    # --- a user's erasure -----------------------------------------------------------------------

    def test_erase_user_deletes_their_runs_and_steps_and_only_theirs(
        self, trace_store: TraceStore
    ) -> None:
        owners = {
            "r1": ("s1", "acme", "ada"),
            "r2": ("s2", "acme", "ada"),
            "r3": ("s1", "acme", "bob"),
            "r4": ("s1", "globex", "ada"),
        }
        for run_id, (session, tenant, user) in owners.items():
            trace_store.start_run(_run(run_id, session, tenant_id=tenant, user_id=user))
            trace_store.write_step(_step(run_id, 0))
        trace_store.write_step(_step("r1", 1, "tool"))
        assert trace_store.user_sessions("acme", "ada") == ["s1", "s2"]
        assert trace_store.erase_user("acme", "ada") == {"trace_runs": 2, "trace_steps": 3}
        assert trace_store.get_run("r1") is None and trace_store.get_steps("r1") == []
        for kept in ("r3", "r4"):
            assert trace_store.get_run(kept) is not None
            assert len(trace_store.get_steps(kept)) == 1
        assert trace_store.user_sessions("acme", "ada") == []
        assert trace_store.erase_user("acme", "ada") == {"trace_runs": 0, "trace_steps": 0}
