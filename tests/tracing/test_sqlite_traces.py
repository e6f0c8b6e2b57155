from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from keel.stores import SQLiteDatabase
from keel.stores._dialect import SQLITE, _json_text
from keel.stores._sql_traces import SQLTraceStore, _json_bytes, trace_sql
from keel.testing.trace_conformance import TraceStoreConformance
from keel.tracing import RunQuery, Tracer, TraceStore


class TestSQLiteTraceStore(TraceStoreConformance):
    @pytest.fixture
    def trace_store(self, tmp_path: Path) -> Iterator[TraceStore]:
        with SQLiteDatabase(tmp_path / "keel.db") as database:
            store = SQLTraceStore(database)
            store.setup()
            yield store
            store.close()


class TestInMemorySQLiteTraceStore(TraceStoreConformance):
    @pytest.fixture
    def trace_store(self) -> Iterator[TraceStore]:
        with SQLiteDatabase(":memory:") as database:
            store = SQLTraceStore(database)
            store.setup()
            yield store
            store.close()


def test_traces_share_the_database_file_as_their_own_component(tmp_path: Path) -> None:
    db = SQLiteDatabase(tmp_path / "keel.db")
    store = SQLTraceStore(db)
    store.setup()
    assert db.schema_versions() == {"core": 1, "traces": 3}
    store.close()  # not its database: still usable
    assert db.connection().execute("SELECT count(*) FROM trace_runs").fetchone()[0] == 0
    db.close()


def test_list_filters_use_indexes(tmp_path: Path) -> None:
    store = SQLTraceStore(SQLiteDatabase(tmp_path / "keel.db"))
    store.setup()
    conn = store.db.connection()
    plans = {
        "session": "SELECT * FROM trace_runs WHERE session_id = 'x' ORDER BY started_at DESC",
        "errors": "SELECT * FROM trace_runs WHERE tool_errors > 0 ORDER BY started_at DESC",
        "steps_of_run": "SELECT * FROM trace_steps WHERE run_id = 'r' ORDER BY seq",
    }
    for name, sql in plans.items():
        plan = " ".join(str(row[-1]) for row in conn.execute(f"EXPLAIN QUERY PLAN {sql}"))
        assert "USING INDEX" in plan or "USING COVERING INDEX" in plan, (name, plan)
    # The counter filters as the store runs them: the runs that are not running by the partial
    # counter index, the running ones by the status index; never a scan of every run.
    for query, index in (
        (RunQuery(min_steps=10), "trace_runs_ended_steps"),
        (RunQuery(min_model_calls=10), "trace_runs_ended_model_calls"),
    ):
        sql, params = trace_sql(SQLITE).list_runs(query)
        steps = [str(row[-1]) for row in conn.execute(f"EXPLAIN QUERY PLAN {sql}", params)]
        assert any(f"USING INDEX {index} " in step for step in steps), steps
        assert any("USING INDEX trace_runs_status (status=?)" in step for step in steps), steps
        assert not [step for step in steps if step.startswith("SCAN trace_runs")], steps
    store.close()
    store.db.close()


def test_nothing_unmasked_reaches_the_file(tmp_path: Path) -> None:
    path = tmp_path / "keel.db"
    store = SQLTraceStore(SQLiteDatabase(path))
    tracer = Tracer(store)
    secrets = [
        "sk-proj-Zq8XvB2nM4kL6pR0tY1uW3eQ",
        "AKIAIOSFODNN7EXAMPLE",
        "ghp_" + "a1B2c3D4e5" * 4,
        "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N",
        "jane.doe@example.org",
        "hunter2hunter2",
    ]
    with tracer.start_run(
        "sess", user_id="u", input=f"use {secrets[0]}", attributes={"email": secrets[4]}
    ) as run:
        with run.step(
            "model",
            "scripted:x",
            raw_output=f"Authorization: Bearer {secrets[3]}",
            parsed_action={"say": [f"contact {secrets[4]}"], "nested": {"k": secrets[1]}},
            budget={"note": f"password={secrets[5]}"},
        ):
            run.record(
                "tool",
                "git",
                tool_arguments=f'{{"token": "{secrets[2]}"}}',
                tool_result={"aws": secrets[1], "list": [secrets[0]]},
                error=RuntimeError(f"failed for {secrets[4]}"),
                attributes={"deep": [{"x": secrets[2]}]},
            )
        run.transition("start", "booking", state_version=2, attributes={"who": secrets[4]})
        run.end(output=f"done, receipt sent to {secrets[4]}")
    store.close()
    store.db.close()
    raw = path.read_bytes()
    wal = path.with_name(path.name + "-wal")
    if wal.exists():
        raw += wal.read_bytes()
    for secret in secrets:
        assert secret.encode() not in raw, secret
    conn = sqlite3.connect(path)
    rows = conn.execute("SELECT * FROM trace_steps").fetchall()
    rows += conn.execute("SELECT * FROM trace_runs").fetchall()
    conn.close()
    text = repr(rows)
    assert "password=<SECRET_1>" in text  # the masker's, which the vault can reveal
    for secret in secrets:
        assert secret not in text, secret


def test_a_batch_is_one_transaction(tmp_path: Path) -> None:
    from datetime import UTC, datetime

    from keel.tracing import Run, Step
    from keel.tracing._store import RunEnding

    store = SQLTraceStore(SQLiteDatabase(tmp_path / "keel.db"))
    store.setup()
    now = datetime(2026, 1, 1, tzinfo=UTC)
    store.start_run(Run(run_id="r1", session_id="s", agent="a", started_at=now))
    step = Step(run_id="r1", step_id="s0", seq=0, kind="model", started_at=now, ended_at=now)
    with pytest.raises(Exception, match="no such run"):
        # The step is fine, the end is not: the whole batch is rolled back.
        store.write_batch(run=None, steps=[step], end=RunEnding("other", "failed", now))
    assert store.get_steps("r1") == []
    commits: list[str] = []
    conn = store.db.connection()
    conn.set_trace_callback(lambda sql: commits.append(sql) if sql == "COMMIT" else None)
    store.write_batch(run=None, steps=[step], end=RunEnding("r1", "succeeded", now))
    conn.set_trace_callback(None)
    assert commits == ["COMMIT"]
    assert [s.step_id for s in store.get_steps("r1")] == ["s0"]
    store.close()
    store.db.close()


def test_a_batch_that_ends_the_run_of_its_steps_writes_the_run_once(tmp_path: Path) -> None:
    """A turn's last flush: its steps' totals and the run's end are one UPDATE of the run,
    which also finds it (no SELECT of the run before the steps)."""
    from datetime import UTC, datetime

    from keel.tracing import Run, Step
    from keel.tracing._store import RunEnding

    store = SQLTraceStore(SQLiteDatabase(tmp_path / "keel.db"))
    now = datetime(2026, 1, 1, tzinfo=UTC)
    store.start_run(Run(run_id="r1", session_id="s", agent="a", started_at=now))
    steps = [
        Step(run_id="r1", step_id=f"s{seq}", seq=seq, kind=kind, started_at=now, prompt_tokens=3)
        for seq, kind in enumerate(("model", "tool"))
    ]
    statements: list[str] = []
    conn = store.db.connection()
    conn.set_trace_callback(statements.append)
    store.write_batch(run=None, steps=steps, end=RunEnding("r1", "succeeded", now, "done"))
    conn.set_trace_callback(None)
    assert [sql.split(" SET ")[0] for sql in statements if "trace_runs" in sql] == [
        "UPDATE trace_runs"
    ]
    run = store.get_run("r1")
    assert run is not None
    assert (run.status, run.output, run.step_count, run.model_calls) == ("succeeded", "done", 2, 1)
    assert (run.tool_calls, run.prompt_tokens) == (1, 6)
    store.close()
    store.db.close()


def test_json_columns_keep_what_json_keeps(tmp_path: Path) -> None:
    """JSON columns kept as text hold what ``json.dumps`` wrote: infinities and NaN too."""
    import math
    from datetime import UTC, datetime

    from keel.tracing import Run, Step

    store = SQLTraceStore(SQLiteDatabase(tmp_path / "keel.db"))
    now = datetime(2026, 1, 1, tzinfo=UTC)
    store.start_run(Run(run_id="r1", session_id="s", agent="a", started_at=now))
    attributes = {"ratio": math.inf, "drift": math.nan, "é\u2028": ["a", 1, None, True]}
    budget = {"window": 8192, "sections": {"history": 1200}, "big": 10**20}
    store.write_step(
        Step(
            run_id="r1",
            step_id="s0",
            seq=0,
            kind="model",
            started_at=now,
            budget=budget,
            attributes=attributes,
        )
    )
    (step,) = store.get_steps("r1")
    assert step.budget == budget
    assert step.attributes["ratio"] == math.inf and math.isnan(step.attributes["drift"])
    assert step.attributes["é\u2028"] == ["a", 1, None, True]
    store.close()
    store.db.close()


def test_a_steps_json_is_stored_as_the_text_it_was(tmp_path: Path) -> None:
    """A step's JSON is bound as UTF-8 bytes and cast to TEXT (fast65): each column holds the
    text pydantic-core writes, of type text (never a blob), non-ASCII and escapes as they
    were (a text pydantic-core will not write is given to ``json.dumps``, as before)."""
    from datetime import UTC, datetime

    from pydantic_core import to_json

    from keel.tracing import Run, Step

    store = SQLTraceStore(SQLiteDatabase(tmp_path / "keel.db"))
    now = datetime(2026, 1, 1, tzinfo=UTC)
    store.start_run(Run(run_id="r1", session_id="s", agent="a", started_at=now))
    budget = {"summary": 'Earlier… «the user» said "hi"\n\x00', "tokens": 12}
    action = {"action": "final", "text": "\u2028日本"}
    attributes = {"note": "tab\there", "n": [1.5, None, True]}
    store.write_step(
        Step(
            run_id="r1",
            step_id="s0",
            seq=0,
            kind="model",
            started_at=now,
            budget=budget,
            parsed_action=action,
            attributes=attributes,
        )
    )
    row = (
        store.db.connection()
        .execute(
            "SELECT typeof(budget), budget, typeof(parsed_action), parsed_action, "
            "typeof(attributes), attributes FROM trace_steps WHERE step_id = 's0'"
        )
        .fetchone()
    )
    assert row[0::2] == ("text", "text", "text")
    assert row[1] == to_json(budget).decode()
    assert row[3] == to_json(action).decode()
    assert row[5] == to_json(attributes).decode()
    (step,) = store.get_steps("r1")
    assert (step.budget, step.parsed_action, step.attributes) == (budget, action, attributes)
    assert _json_bytes({"lone": "a\ud800"}) == _json_text({"lone": "a\ud800"})
    store.close()
    store.db.close()
