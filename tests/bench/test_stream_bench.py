"""``keel bench stream`` as a user runs it: a real llama.cpp server, a few turns."""

from __future__ import annotations

import pytest

from tests.bench._cli import bench_json

pytestmark = pytest.mark.slow


def test_bench_stream_json_contract_and_no_violations() -> None:
    report = bench_json("stream", "--latency-turns", "1", "--turns", "6", "--max-tokens", "12")
    assert report["turns"] == 6 and report["violations"] == 0, report["chaos"]
    ttft = report["ttft_ms_p50"]
    assert set(ttft) == {"sdk", "sdk_masked", "agent_stream", "agent_stream_unmasked"}
    # The SDK's caller masking as keel does shows its first text no sooner than the raw delta.
    assert ttft["sdk_masked"] >= ttft["sdk"]
    for key in (
        "added_ttft_ms_p50",
        "added_ttft_ms_p95",
        "added_ttft_ms_vs_masked_sdk_p50",
        "added_ttft_ms_vs_masked_sdk_p95",
        "tokens_per_s",
        "cancellations",
        "cuts",
    ):
        assert key in report
    assert report["tokens_per_s"] > 0
    # The wire clock saw every measured request and its first text (a NaN would be a miss).
    wire = report["wire"]
    assert set(wire) == {
        f"added_ttft_ms{way}_p{q}" for way in ("", "_unmasked", "_vs_masked_sdk") for q in (50, 95)
    }
    assert all(value == value for value in wire.values()), wire
    # The seed makes both faults happen in a run this short.
    assert report["cancellations"] > 0 and report["cuts"] > 0
