"""A fresh session filling its window is not a death spiral, and keel prints nothing of it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

_SCRIPT = textwrap.dedent(
    """
    import asyncio
    import sys

    from keel.context import ContextBudget
    from keel.runtime import Agent
    from keel.state import AgentState, StateStore
    from keel.stores import SQLiteDatabase, SQLStateBackend
    from keel.testing import ScriptedModel

    async def main() -> None:
        database = SQLiteDatabase(sys.argv[1])
        agent = Agent(
            ScriptedModel(lambda call: "Noted. " + "detail " * 40),
            state=StateStore(SQLStateBackend(database), AgentState),
            system_prompt="You are brief.",
            context=ContextBudget(working_budget=6_000),
        )
        for turn in range(24):
            await agent.handle("fresh", "u1", f"message {turn} " + "words " * 60)
        snapshot = agent.monitor.snapshot(session_id=agent.session_key("fresh"))
        print("growth", round(snapshot.prompt_growth, 2), "warnings", list(snapshot.warnings))
        # A real indicator crossing is logged (keel.guards), yet not printed by keel.
        for _ in range(20):
            agent.monitor.record_call(session_id="failing", retry=True)
        print("failing", list(agent.monitor.snapshot(session_id="failing").warnings))
        database.close()

    asyncio.run(main())
    """
)


def test_a_filling_window_warns_nothing_and_writes_nothing_to_stderr(tmp_path: Path) -> None:
    # A plain program that never configured logging, as most users' scripts are.
    result = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(tmp_path / "keel.db")],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ),
    )
    assert result.returncode == 0, result.stderr
    growth = float(result.stdout.split()[1])
    assert growth > 1.5, result.stdout  # the prompt did grow: the window was filling
    assert "warnings []" in result.stdout
    assert "failing ['retry rate 100% > 30%']" in result.stdout
    assert result.stderr == ""
