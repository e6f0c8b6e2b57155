"""``keel bench privacy`` as a user runs it (a small workload), its count of placeholders
reaching tools (none, with a vault or without one), and of injected placeholders resolved."""

from __future__ import annotations

from pathlib import Path

from keel.bench.privacy import _flows_phase
from tests.bench._cli import bench_json


def test_bench_privacy_json_contract() -> None:
    figures = bench_json(
        "privacy",
        "--turns",
        "30",
        "--users",
        "3",
        "--flows",
        "2",
        "--forget-values",
        "200",
        "--rotation-users",
        "300",
        "--rotation-kills",
        "2",
    )
    assert figures["seed"] == 36 and figures["turns"] == 30
    assert figures["placeholders_reaching_tools"] == 0 and figures["flow_tool_calls"] == 10
    assert figures["ticket_calls_with_placeholder"] == 0 and figures["resolutions"] == 30
    assert 0 < figures["resolve_ms_p50"] <= figures["resolve_ms_p95"]
    assert figures["turn_ms_p50"]["vault"] > 0 and "turn_added_ms_p50" in figures
    assert figures["vault_rows_per_value"] >= 1 and figures["vault_bytes_per_value"] > 32
    assert figures["forget_values"] == 200 and figures["forget_seconds"] > 0
    # A fetched page named the users' placeholders (literally, then in words): no value left.
    assert figures["injected_placeholders"] == 60
    assert figures["injected_placeholders_resolved"] == 0
    assert figures["rotation_kills_survived"] == figures["rotation_kills"] == 2
    assert figures["rotation_users"] == 300 and figures["rotation_finished"] is True


def test_without_a_vault_no_flow_tool_gets_a_placeholder_its_calls_are_not_made(
    tmp_path: Path,
) -> None:
    figures = _flows_phase(2, 36, tmp_path, vault=False)
    # Per flow, only the manager's look-up holds no placeholder: the receipt, the call back,
    # the charge and the manager's call are refused before they run (issue 44, defect 10).
    assert figures["placeholders_reaching_tools"] == 0 and figures["flow_tool_calls"] == 2
