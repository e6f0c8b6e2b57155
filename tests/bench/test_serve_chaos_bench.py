"""``keel bench serve --chaos`` as a user runs it: real workers on a PostgreSQL the bench stops
and starts under load; the figures read back from the sessions' state and the effects. (The
other kinds' faults are tested through HTTP in tests/service/test_store_outage.py.)"""

from __future__ import annotations

import pytest

from tests.bench._cli import bench_json

pytestmark = pytest.mark.slow

_PER_KIND = {
    "injections",
    "down_s",
    "turns_sent",
    "committed",
    "failed_fast",
    "lost_turns",
    "duplicated_turns",
    "double_effects",
    "recover_s_p50",
    "recover_s_max",
    "in_doubt",
    "in_doubt_left",
}


def test_bench_serve_chaos_loses_and_repeats_nothing_while_stores_go_away() -> None:
    report = bench_json(
        "serve",
        *("--chaos", "postgres", "--workers", "2", "--sessions", "6"),
        *("--duration", "9", "--model-latency-ms", "50"),
    )
    assert set(report["chaos"]) == {"postgres"}
    assert set(report["keel_added_ms"]) >= {"p50", "p99"}
    for kind, figures in report["chaos"].items():
        assert set(figures) >= _PER_KIND, (kind, figures)
        assert figures["injections"] >= 1, (kind, figures)
        assert figures["committed"] == figures["turns_sent"] > 0, (kind, figures)
        assert figures["lost_turns"] == 0 and figures["duplicated_turns"] == 0, (kind, figures)
        assert figures["double_effects"] == 0 and figures["in_doubt_left"] == 0, (kind, figures)
    postgres = report["chaos"]["postgres"]
    # Turns sent while it was down were answered 503, and the workers served again after.
    assert postgres["failed_fast"] > 0 and postgres["down_s"] > 0, postgres
    assert postgres["recover_s_max"] is not None, postgres
