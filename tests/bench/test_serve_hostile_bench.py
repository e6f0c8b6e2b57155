"""``keel bench serve --hostile`` as a user runs it: one real worker against floods of chunked
bodies and bodies a byte a second, while normal sessions run; its last line is the report."""

from __future__ import annotations

import pytest

from tests.bench._cli import bench_json

pytestmark = pytest.mark.slow


def test_bench_serve_hostile_reports_a_bounded_worker_that_lost_no_turn() -> None:
    report = bench_json("serve", "--hostile", "--duration", "6")
    for name in ("peak_rss_ratio", "normal_turns_lost", "health_p99_ms", "hostile_requests"):
        assert name in report, report
    assert report["normal_turns_sent"] > 0 and report["normal_turns_lost"] == 0, report
    assert report["normal_turns_duplicated"] == 0, report
    # Every hostile request was answered (413, 408) or had its connection closed under it.
    assert report["hostile_requests"] > 0 and report["refused_413"] > 0, report
    assert sum(report["hostile_statuses"].values()) == report["hostile_requests"], report
    assert not set(report["hostile_statuses"]) - {
        "413",
        "408",
        "ConnectionResetError",
        "BrokenPipeError",
    }, report
    # The worker reads no body past the limit: its memory stays near its idle size.
    assert report["peak_rss_ratio"] <= 1.5, report
    assert report["health_probes"] > 0, report
