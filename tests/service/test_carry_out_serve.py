"""A real ``keel serve --agent`` process with two workers: a customer's refund parks on an
operator's approval, ``keel approvals approve ID`` in a separate CLI process records the
decision, and a worker carries it out with nobody asking: the refund is made exactly once
(counted in the shop's own table) and the session's history shows the turn that went on."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from tests.service.conftest import create_key, keel_serve

ROOT = Path(__file__).resolve().parents[2]


def _refunds(data_dir: Path) -> list[tuple[str, float, str]]:
    """The shop's refunds table: the refund's effect, as the shop sees it."""
    if not (data_dir / "shop.db").exists():
        return []
    with sqlite3.connect(data_dir / "shop.db") as shop:
        try:
            return list(shop.execute("SELECT order_id, amount, reason FROM refunds"))
        except sqlite3.OperationalError:  # the table is made on the first refund
            return []


def _until(what: str, check: Any, deadline_s: float = 60.0) -> Any:
    deadline = time.monotonic() + deadline_s
    while not (found := check()):
        assert time.monotonic() < deadline, f"not within {deadline_s} s: {what}"
        time.sleep(0.25)
    return found


def test_a_worker_carries_out_an_approval_made_on_the_command_line(tmp_path: Path) -> None:
    from tests.service._support_model import support_model_server

    data = tmp_path / "data"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
        "KEEL_DATA_DIR": str(data),
        "KEEL_EMBEDDER": "hashing:64",
    }
    customer = create_key("acme", env, user="ada")
    operator = {"Authorization": f"Bearer {create_key('acme', env)}"}
    with support_model_server() as model_url:
        env["KEEL_MODEL"] = f"openai-compatible:support@{model_url}"
        spec = "examples.ecommerce_support:build"
        arguments = ("--agent", spec, "--no-memory", "--workers", "2")
        with keel_serve(*arguments, env=env, cwd=ROOT) as served:
            asked = {
                "model": "keel",
                "messages": [
                    {"role": "user", "content": "Please refund my order, I'm ada@example.com"}
                ],
            }
            parked = httpx.post(
                f"{served.url}/v1/chat/completions",
                json=asked,
                headers={"Authorization": f"Bearer {customer}"},
                timeout=60,
            )
            assert parked.status_code == 200, parked.text
            keel = parked.json()["keel"]
            assert keel["status"] == "awaiting_approval", keel
            session = keel["session_id"]
            [request] = httpx.get(f"{served.url}/v1/approvals", headers=operator, timeout=30).json()

            approved = subprocess.run(
                [
                    *(sys.executable, "-m", "keel", "approvals", "approve", request["id"]),
                    *("--tenant", "acme", "--by", "olga"),
                ],
                env=env,
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
            assert approved.returncode == 0, approved.stderr
            # The command line records the decision (it holds no agent and no tools); whether a
            # worker's pass carried it out before the command exited is the machine's timing,
            # so it is not asserted here (tests/approvals/test_cli.py pins the recording).
            assert f"{request['id']}: approved by operator:olga" in approved.stdout

            _until("the refund was made", lambda: _refunds(data))

            def went_on() -> list[dict[str, Any]] | None:
                read = httpx.get(
                    f"{served.url}/v1/sessions/{session}", headers=operator, timeout=30
                )
                state = read.json()["state"]
                runtime = state["runtime"]
                # Parked no more, and the turn that went on committed (not mid-turn).
                done = not runtime["awaiting"] and runtime["open_turn"] is None
                return state["messages"] if done else None

            messages = _until("the session's turn went on", went_on)
            last = messages[-1]
            assert last["role"] == "assistant" and "refunded 40.00 on order 1024" in last["content"]
            notes = [m for m in messages if "approved by operator:olga" in json.dumps(m)]
            assert len(notes) == 1, notes
        assert _refunds(data) == [("1024", 40.0, "damaged")]
        assert "Traceback" not in served.stderr, served.stderr
