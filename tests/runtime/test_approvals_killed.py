"""An approved call across SIGKILLs (issue 37): a worker killed before the decision commits,
right after it, or inside the approved tool before or after its effect; the decision sent
again (as an HTTP retry would) or the session resumed by a fresh process. The refund is
counted from the effects file: never twice, and once when the kill came before it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]


def _worker(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable,
        "-m",
        "tests.runtime.approval_worker",
        "--db",
        str(tmp_path / "keel.db"),
        "--effects",
        str(tmp_path / "effects.txt"),
        *args,
    ]
    return subprocess.run(
        command, cwd=_ROOT, capture_output=True, text=True, timeout=120, check=False
    )


def _reply(done: subprocess.CompletedProcess[str]) -> dict[str, object]:
    assert done.returncode == 0, done.stderr
    line = [line for line in done.stdout.splitlines() if line.startswith("{")][-1]
    reply: dict[str, object] = json.loads(line)
    return reply


def _effects(tmp_path: Path) -> list[str]:
    path = tmp_path / "effects.txt"
    return path.read_text().split() if path.exists() else []


@pytest.mark.parametrize("point", ["before_decision_commits", "after_decision_commits"])
@pytest.mark.parametrize("then", ["decide", "resume"])
def test_killed_around_the_decision_the_call_runs_once(
    tmp_path: Path, point: str, then: str
) -> None:
    parked = _reply(_worker(tmp_path, "--do", "ask"))
    assert parked["status"] == "awaiting_approval"
    [approval] = parked["approvals"]  # type: ignore[misc]
    killed = _worker(tmp_path, "--do", "decide", "--approval", approval, "--kill-at", point)
    assert killed.returncode == -signal.SIGKILL and _effects(tmp_path) == []
    if then == "decide":
        # The decision sent again: it settles (or finds itself settled) and the turn goes on.
        after = _reply(_worker(tmp_path, "--do", "decide", "--approval", approval))
    else:
        # A fresh process resumes the session: it carries out a decision that is in.
        after = _reply(_worker(tmp_path, "--do", "resume"))
        if point == "before_decision_commits":
            # Nothing was decided: it still waits; deciding then runs it.
            assert after["status"] == "awaiting_approval" and _effects(tmp_path) == []
            after = _reply(_worker(tmp_path, "--do", "decide", "--approval", approval))
    assert after["status"] == "completed", after
    assert "REFUNDED W1" in str(after["text"])
    assert _effects(tmp_path) == ["W1"]
    again = _reply(_worker(tmp_path, "--do", "decide", "--approval", approval))
    assert again["replayed"] and _effects(tmp_path) == ["W1"]


@pytest.mark.parametrize("point", ["tool_before_effect", "tool_after_effect"])
def test_killed_inside_the_approved_tool_it_is_never_run_again(tmp_path: Path, point: str) -> None:
    parked = _reply(_worker(tmp_path, "--do", "ask"))
    [approval] = parked["approvals"]  # type: ignore[misc]
    killed = _worker(tmp_path, "--do", "decide", "--approval", approval, "--kill-at", point)
    assert killed.returncode == -signal.SIGKILL
    ran = ["W1"] if point == "tool_after_effect" else []
    assert _effects(tmp_path) == ran
    after = _reply(_worker(tmp_path, "--do", "decide", "--approval", approval))
    # Started and never recorded: in doubt, for an operator to settle; not run blindly again.
    assert after["status"] == "completed" and "unknown whether it took effect" in str(after["text"])
    assert _effects(tmp_path) == ran


def test_killed_before_the_turn_parked_a_decision_still_runs_the_call_once(
    tmp_path: Path,
) -> None:
    killed = _worker(tmp_path, "--do", "ask", "--kill-at", "after_request_added")
    assert killed.returncode == -signal.SIGKILL
    # The request is in the queue; the turn never parked (it is left open).
    listed = _worker(tmp_path, "--do", "pending")
    assert listed.returncode == 0, listed.stderr
    [approval] = json.loads(listed.stdout.strip().splitlines()[-1])["pending"]
    after = _reply(_worker(tmp_path, "--do", "decide", "--approval", approval))
    assert after["status"] == "completed" and "REFUNDED W1" in str(after["text"]), after
    assert _effects(tmp_path) == ["W1"]
    again = _reply(_worker(tmp_path, "--do", "decide", "--approval", approval))
    assert again["replayed"] and _effects(tmp_path) == ["W1"]
