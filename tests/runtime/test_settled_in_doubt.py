"""Through the Agent: a call left in doubt and settled by an operator (``keel tools resolve``)
is never run again by a repeat of the same call (issue 37, "A call the operator settled runs
again"); settled as failed, the repeat runs once."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from keel.runtime import Agent
from keel.testing import ScriptedModel
from keel.tools import tool

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _keel(*args: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "keel", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])},
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.parametrize("outcome", ["succeeded", "failed"])
async def test_a_call_an_operator_settled_is_not_run_again_by_its_repeat(outcome: str) -> None:
    effects: list[str] = []
    release = threading.Event()

    @tool(side_effect=True, idempotent=False, timeout_s=0.2)
    def cancel_order(order: str) -> str:
        """Cancel an order.

        Args:
            order: The order id.
        """
        effects.append(order)
        if len(effects) == 1:
            release.wait(30)  # the shop's first answer never comes in time
        return f"cancelled {order}"

    cancel = ScriptedModel.tool_call("cancel_order", json.dumps({"order": "#W1"}))
    model = ScriptedModel([cancel, cancel, "Done."])
    agent = Agent.embedded(model, system_prompt="You run a shop.", tools=[cancel_order])
    agent.memory = None
    try:
        first = await agent.handle("s1", "u1", "Cancel #W1.")
        assert first.status == "tool_in_doubt" and effects == ["#W1"]
        listed = json.loads(_keel("tools", "in-doubt", "--json").strip().splitlines()[-1])
        [entry] = listed["in_doubt"]
        _keel(
            "tools",
            "resolve",
            str(entry["key"]),
            "--outcome",
            outcome,
            "--content",
            "cancelled #W1 (checked by hand)",
        )
        second = await agent.handle("s1", "u1", "Cancel #W1, please.")
        assert second.status == "completed", (second, effects)
        state = agent.session_state("s1")
        assert state is not None
        last_tool = [m.content for m in state.messages if m.role == "tool"][-1]
        if outcome == "succeeded":
            # Settled as done: the repeat gets the operator's result and runs nothing.
            assert effects == ["#W1"]
            assert "cancelled #W1 (checked by hand)" in last_tool
        else:
            # Settled as not done: the repeat runs, once.
            assert effects == ["#W1", "#W1"]
    finally:
        release.set()
        await asyncio.sleep(0.3)
        await agent.aclose()
