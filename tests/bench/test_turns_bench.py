"""``keel bench turns`` as a user runs it (a small workload)."""

from __future__ import annotations

from tests.bench._cli import bench_json


def test_bench_turns_json_contract() -> None:
    figures = bench_json("turns", "--turns", "20", "--bucket", "10")
    assert figures["turns"] == 20 and figures["tool_executions"] == 20
    assert len(figures["buckets_ms_p50"]) == 2 and figures["flatness"] > 0
    assert figures["p50_ms"] > 0 and figures["turns_per_s"] > 0 and figures["db_bytes"] > 0
    assert figures["memory_on"]["tool_executions"] == 20
    # Memory on against memory off in the same run, and CPU per turn for each.
    assert figures["cpu_ms_per_turn"] > 0 and figures["memory_on"]["cpu_ms_per_turn"] > 0
    assert figures["memory_on"]["p50_vs_memory_off"] > 0
    assert figures["memory_on"]["cpu_vs_memory_off"] > 0
    assert figures["langgraph"]["db_bytes"] > 0 and figures["speedup_vs_langgraph"] > 0


def test_bench_turns_memory_with_history_is_a_separate_figure() -> None:
    figures = bench_json(
        "turns", "--turns", "6", "--bucket", "3", "--no-langgraph", "--memory-history", "4"
    )
    # The plain memory-on session is still measured and reported as before ...
    assert figures["memory_on"]["tool_executions"] == 6
    assert "earlier_turns" not in figures["memory_on"]
    # ... and next to it the same session for a user whose earlier session memory holds.
    held = figures["memory_with_history"]
    assert held["earlier_turns"] == 4 and held["tool_executions"] == 6
    assert len(held["buckets_ms_p50"]) == 2 and held["p50_vs_memory_off"] > 0
    assert "memory_with_history" not in bench_json(
        "turns", "--turns", "2", "--no-langgraph", "--no-memory", "--memory-history", "4"
    )


def test_bench_turns_on_a_throwaway_postgres() -> None:
    figures = bench_json(
        "turns",
        "--turns",
        "10",
        "--bucket",
        "5",
        "--no-memory",
        "--no-langgraph",
        "--database",
        "postgres",
    )
    assert figures["database"] == "postgres" and figures["tool_executions"] == 10
    # Counted by the server: the session's rows, not an empty database's size.
    assert 0 < figures["db_bytes"] < 50_000_000


def test_bench_turns_repeats_combine_per_bucket_medians() -> None:
    from keel.bench.turns import _combined

    runs = [
        {
            "buckets_ms_p50": p50s,
            "buckets_ms_p95": [2 * v for v in p50s],
            "flatness": p50s[-1] / p50s[0],
            "turns_per_s": rate,
            "db_bytes": 100,
            "tool_executions": 4,
            "times_ms": times,
        }
        for p50s, rate, times in (
            ([4.0, 9.0], 100.0, [4.0, 4.0, 9.0, 9.0]),  # a slow spell at the end
            ([4.0, 4.0], 120.0, [4.0, 4.0, 4.0, 4.0]),
            ([5.0, 5.0], 110.0, [5.0, 5.0, 5.0, 5.0]),
        )
    ]
    combined = _combined(runs, bucket=2)
    assert combined["buckets_ms_p50"] == [4.0, 5.0]
    assert combined["flatness"] == 1.25
    assert combined["flatness_of_each_run"] == [2.25, 1.0, 1.0]
    assert combined["turns_per_s"] == 110.0 and combined["repeats"] == 3
    assert combined["p50_ms"] == 4.5  # over every turn of every run
