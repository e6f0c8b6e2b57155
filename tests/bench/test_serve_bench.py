"""``keel bench serve`` as a user runs it: real worker processes SIGKILLed under load, and the
figures read back from the sessions' state and the effects table."""

from __future__ import annotations

import pytest

from tests.bench._cli import bench_json

pytestmark = pytest.mark.slow


def test_bench_serve_loses_and_repeats_nothing_while_workers_are_killed() -> None:
    report = bench_json(
        "serve",
        *("--workers", "2", "--sessions", "8", "--duration", "8", "--kill-every", "2.5"),
        *("--model-latency-ms", "50"),
    )
    for figures in (report, report["sqlite"]):
        assert figures["kills"] >= 2, figures
        assert figures["turns_committed"] == figures["turns_sent"] > 0, figures
        assert figures["lost_turns"] == 0 and figures["duplicated_turns"] == 0, figures
        assert figures["double_effects"] == 0 and figures["missing_effects"] == 0, figures
        assert figures["effects_without_turn"] == 0 and figures["in_doubt_left"] == 0, figures
        assert set(figures["keel_added_ms"]) == {"p50", "p95", "p99", "turns"}
        # The calm turns are those outside every kill window, among the first-attempt ones.
        assert figures["kill_windows_s"] > 0, figures
        calm, first = figures["keel_added_ms"], figures["keel_added_ms_first_attempt"]
        assert calm["turns"] <= first["turns"] <= figures["turns_committed"], figures
        if figures["workers"] > 1:
            # While one worker restarts the others keep answering first time, inside the window;
            # a lone worker (SQLite) answers nothing first time until it is back, so it may have
            # no such turns at all.
            assert calm["turns"] < first["turns"], figures
    assert report["workers"] == 2 and report["sqlite"]["workers"] == 1


def test_bench_serve_with_memory_gives_the_workers_agents_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KEEL_EMBEDDER", "hashing:64")  # the workers read it from the settings
    report = bench_json(
        "serve",
        *("--workers", "1", "--sessions", "4", "--duration", "4", "--kill-every", "0"),
        *("--model-latency-ms", "20", "--no-sqlite", "--memory"),
    )
    assert report["memory"] is True and report["lost_turns"] == 0, report
    assert report["turns_committed"] == report["turns_sent"] > 0, report
    # Each committed turn left its words in memory: the user's and the model's.
    assert report["memory_records"] >= report["turns_committed"], report
