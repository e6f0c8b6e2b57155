"""With the service running, a decision made on the command line (``keel approvals approve``,
which only records it) is carried out by a worker's background task, without any client
asking: the tool's effect happens exactly once, even with two workers on one database, and the
session's history shows the turn that went on (issue 45). Real uvicorn servers, real HTTP, the
CLI in a process of its own."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from keel.errors import UsageError
from keel.messages import Message
from keel.service import build_service
from keel.settings import load_settings
from keel.testing import ScriptedCall, ScriptedModel
from keel.tools import tool
from tests.service.conftest import serving

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _model(call: ScriptedCall) -> Message | str:
    """``refund ORDER``: calls the refund; once the turn goes on, says what keel told it."""
    words = call.last_user_text.split()
    if call.messages[-1].role == "user" and words[:1] == ["refund"]:
        return ScriptedModel.tool_call("issue_refund", json.dumps({"order_id": words[1]}))
    notes = [m.content for m in call.messages if m.role == "system" and "approval" in m.content]
    return "Went on. " + (notes[-1] if notes else "nothing")


def _refunds(ledger: Path) -> list[str]:
    return ledger.read_text().splitlines() if ledger.exists() else []


@contextlib.contextmanager
def _worker(database: str, ledger: Path, data_dir: Path) -> Iterator[tuple[str, Any]]:
    """One worker of the service (its own agents and stores) on ``database``, on uvicorn."""

    @tool(approval="operator")
    def issue_refund(order_id: str) -> str:
        """Refund an order.

        Args:
            order_id: The order.
        """
        with ledger.open("a") as written:  # the effect, counted from the file it leaves
            written.write(f"refund {order_id}\n")
        return f"refunded {order_id}"

    app, agents, keys = build_service(
        database,
        model=ScriptedModel(_model),
        tools=[issue_refund],
        memory=False,
        settings=load_settings(data_dir=data_dir),
    )
    try:
        with serving(app) as running:
            yield running.url, keys
        assert not running.thread.is_alive(), "the server did not stop (the carrier hung?)"
    finally:
        agents.backends.close()


def _approve(database: str, request_id: str) -> None:
    """``keel approvals approve ID`` as an operator types it."""
    done = subprocess.run(
        [
            *(sys.executable, "-m", "keel", "approvals", "approve", request_id),
            *("--by", "alice", "--tenant", "acme", "--database", database),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])},
    )
    assert done.returncode == 0, done.stderr


def _until(what: str, check: Callable[[], bool], deadline_s: float = 60.0) -> None:
    deadline = time.monotonic() + deadline_s
    while not check():
        assert time.monotonic() < deadline, f"not within {deadline_s} s: {what}"
        time.sleep(0.2)


def test_a_decision_on_the_command_line_is_carried_out_by_a_worker_once(tmp_path: Path) -> None:
    database = f"sqlite:///{tmp_path / 'keel.db'}"
    ledger = tmp_path / "refunds.txt"
    with (
        _worker(database, ledger, tmp_path / "one") as (first_url, keys),
        _worker(database, ledger, tmp_path / "two") as (second_url, _),
    ):
        headers = {"Authorization": f"Bearer {keys.create('acme')}"}
        with httpx.Client(base_url=first_url, headers=headers, timeout=60) as client:

            def park(session: str, order: str) -> str:
                turn = client.post(
                    f"/v1/sessions/{session}/turns",
                    json={"message": f"refund {order}", "user": "ann"},
                )
                assert turn.status_code == 200, turn.text
                body = turn.json()
                assert body["status"] == "awaiting_approval", body
                # What the customer reads: no raw JSON, no tool name (those are the operator's).
                assert body["text"].startswith("I need a colleague to approve this"), body
                assert "{" not in body["text"] and "issue_refund" not in body["text"]
                return str(body["approvals"][0]["id"])

            def state(session: str) -> dict[str, Any]:
                answer = client.get(f"/v1/sessions/{session}")
                assert answer.status_code == 200, answer.text
                found: dict[str, Any] = answer.json()["state"]
                return found

            request_id = park("s1", "1024")
            assert _refunds(ledger) == []
            _approve(database, request_id)

            _until("the refund was made", lambda: _refunds(ledger) == ["refund 1024"])

            def went_on() -> bool:
                runtime = state("s1")["runtime"]
                # Parked no more, and the turn that went on committed (not mid-turn).
                return not runtime["awaiting"] and runtime["open_turn"] is None

            _until("the turn went on", went_on)
            last = state("s1")["messages"][-1]
            assert last["role"] == "assistant" and "approved by operator:alice" in last["content"]

            # Passes go on in both workers: a later decision is carried out too, and the first
            # refund was still made once.
            _approve(database, park("s2", "2048"))
            _until("the second refund", lambda: "refund 2048" in _refunds(ledger))
            assert _refunds(ledger) == ["refund 1024", "refund 2048"]
            replies = [m for m in state("s1")["messages"] if m["role"] == "assistant"]
            assert len([m for m in replies if "approved by" in m["content"]]) == 1
        assert second_url != first_url


def test_the_interval_is_bounded() -> None:
    # Here, not at the top: the test above must fail by its assertion where this is absent.
    from keel.service._carry_out import DecisionCarrier

    for every_s in (0.0, -1.0, 86_400.0):
        with pytest.raises(UsageError, match="carry-out interval"):
            DecisionCarrier(lambda tenant: None, list, every_s=every_s)  # type: ignore[arg-type,return-value]


def test_the_interval_is_a_setting_keel_serve_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``KEEL_CARRY_OUT_EVERY_S`` sets how often each worker passes; out of bounds, the
    settings refuse it (before anything is served)."""
    from keel.errors import ConfigError

    monkeypatch.setenv("KEEL_CARRY_OUT_EVERY_S", "0.5")
    settings = load_settings(data_dir=tmp_path)
    app, agents, _ = build_service(
        f"sqlite:///{tmp_path / 'keel.db'}",
        model=ScriptedModel(["hi"]),
        memory=False,
        settings=settings,
    )
    try:
        assert getattr(app.state.keel, "carry_out_every_s", None) == 0.5
    finally:
        agents.backends.close()
    for wrong in ("0", "86400", "often"):
        monkeypatch.setenv("KEEL_CARRY_OUT_EVERY_S", wrong)
        with pytest.raises(ConfigError, match="carry_out_every_s"):
            load_settings(data_dir=tmp_path)
