"""``keel bench approvals``: its JSON contract, and flows whose every kind and kill point is
counted from the refund tool's own effects."""

from __future__ import annotations

import subprocess
import sys

from tests.bench._cli import bench_json


def test_bench_approvals_json_contract_and_zero_faults() -> None:
    figures = bench_json("approvals", "--flows", "60", "--kills", "9", "--seed", "7")
    for name in (
        "flows",
        "approved_not_run",
        "rejected_run",
        "doubled",
        "lost_turns",
        "kills",
        "decision_to_effect_ms_p50",
        "plain_call_ms_p50",
    ):
        assert name in figures, name
    assert figures["flows"] == 60 and figures["seed"] == 7
    assert set(figures["by_kind"]) == {
        "approve", "reject", "correct", "expire", "duplicate", "concurrent"
    }  # fmt: skip
    assert figures["kills"] == 9 and set(figures["kills_by_point"]) == {
        "random", "tool_before_effect", "tool_after_effect"
    }  # fmt: skip
    assert figures["failures"] == []
    for name in ("approved_not_run", "rejected_run", "doubled", "wrong_arguments", "lost_turns"):
        assert figures[name] == 0, (name, figures)
    assert figures["decision_to_effect_ms_p50"] > 0 and figures["plain_call_ms_p50"] > 0


def test_the_seed_is_printed_first() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "keel", "bench", "approvals", "--flows", "2", "--kills", "0"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    first = done.stdout.splitlines()[0]
    assert first.startswith("seed ") and first.split()[1].isdigit()
