"""``keel bench traces``: what tracing costs the agent, and how fast the trace queries are.

Workload: ``runs`` runs in ``sessions`` sessions, each run ``steps`` steps through the
[`Tracer`][] (the path the runtime takes: redaction, validation, one SQLite
transaction per step): a model step with a budget report and a ~2 kB raw output, then a tool step
with ~8 kB of tool result inside it, alternating. The embedded SQLite file runs in WAL mode with
``synchronous=NORMAL``. Reported: per-step write latency (the cost of ending a step: building,
redacting and writing it; p50, p95, mean, in microseconds), step writes per second, the time
of ``runs list --min-steps`` over the whole database, of loading the longest run's tree and of
the per-session stats, and the database size.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from keel.messages import Usage
from keel.settings import load_settings
from keel.stores import Backends, SQLiteDatabase
from keel.tracing import RunQuery, Tracer, percentile

__all__ = ["run_trace_bench"]

_OUTPUT = "The flight TP123 from LIS to OSL leaves at 09:10 and costs 212 EUR; " * 30
_RESULT = '{"flight": "TP123", "seats": 42, "fare": "economy", "price": 212.0}, ' * 120


def _ms(start: float) -> float:
    return round((time.perf_counter() - start) * 1000, 3)


def run_trace_bench(
    *, runs: int = 200, steps: int = 20, sessions: int = 10, path: Path | None = None
) -> dict[str, Any]:
    """Run the workload and return its figures (see the module docstring)."""
    with tempfile.TemporaryDirectory(prefix="keel-bench-traces-") as tmp:
        db_path = path or Path(tmp) / "keel.db"
        backends = Backends.open(
            f"sqlite:///{db_path}", settings=load_settings(), only=("traces",), redis_url=""
        )
        store = backends.traces
        tracer = Tracer(store, agent="bench")
        latencies: list[float] = []
        started = time.perf_counter()
        for index in range(runs):
            run = tracer.start_run(f"session-{index % sessions}", user_id="bench", input="go")
            remaining = steps
            turn = 0
            while remaining > 0:
                call = run.step(
                    "model",
                    "scripted:policy",
                    state_version=turn,
                    budget={"window": 8192, "reserve": 512, "history": 1000 + 40 * turn},
                )
                call.update(
                    usage=Usage(prompt_tokens=1000 + 40 * turn, completion_tokens=30),
                    raw_output=_OUTPUT,
                    finish_reason="tool_calls",
                )
                if remaining >= 2:
                    tool = run.step(
                        "tool", "search_flights", parent=call, tool_arguments='{"to": "OSL"}'
                    )
                    t0 = time.perf_counter()
                    tool.end(tool_result=_RESULT)
                    latencies.append((time.perf_counter() - t0) * 1e6)
                    remaining -= 1
                t0 = time.perf_counter()
                call.end()
                latencies.append((time.perf_counter() - t0) * 1e6)
                remaining -= 1
                turn += 1
            run.end(output="done")
        total_s = time.perf_counter() - started
        written = len(latencies)

        t = time.perf_counter()
        long_runs = store.list_runs(RunQuery(min_steps=steps, limit=100_000))
        list_ms = _ms(t)
        t = time.perf_counter()
        detail = store.get_run_detail(long_runs[0].run_id) if long_runs else None
        show_ms = _ms(t)
        t = time.perf_counter()
        stats = store.session_stats()
        stats_ms = _ms(t)
        sql = backends.sql
        assert isinstance(sql, SQLiteDatabase)
        sql.connection().execute("PRAGMA wal_checkpoint(TRUNCATE)")
        size = db_path.stat().st_size
        backends.close()
    return {
        "runs": runs,
        "steps_per_run": steps,
        "steps_written": written,
        "write_failures": tracer.write_failures,
        "step_write_us_p50": round(percentile(latencies, 50) or 0.0, 1),
        "step_write_us_p95": round(percentile(latencies, 95) or 0.0, 1),
        "step_write_us_mean": round(statistics.fmean(latencies), 1) if latencies else 0.0,
        "steps_per_second": round(written / total_s, 1) if total_s else 0.0,
        "list_min_steps_ms": list_ms,
        "runs_found": len(long_runs),
        "show_run_ms": show_ms,
        "show_run_steps": len(detail.steps) if detail else 0,
        "stats_ms": stats_ms,
        "stats_sessions": len(stats),
        "database_bytes": size,
        "bytes_per_step": round(size / written) if written else 0,
    }
