"""Runs as ``keel runs`` shows them after real turns: killed runs, step counts, cut replies."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from keel.errors import TruncatedResponseError
from keel.guards import GuardConfig
from keel.messages import Message, ToolCall, Usage
from keel.models import Completion
from keel.runtime import Agent
from keel.testing import ScriptedCall, ScriptedModel
from keel.tools import tool

_WORKER = textwrap.dedent(
    """
    import os
    import signal

    from keel.guards import GuardConfig
    from keel.messages import Message, ToolCall
    from keel.runtime import Agent
    from keel.testing import ScriptedModel
    from keel.tools import tool

    @tool
    def look_up(code: str) -> str:
        \"\"\"Look a booking up.\"\"\"
        os.kill(os.getpid(), signal.SIGKILL)  # the worker dies mid-run, as under OOM or kill -9
        return "never"

    call = ToolCall(id="call_1", name="look_up", arguments='{"code": "AB12"}')
    agent = Agent.embedded(
        ScriptedModel([Message.assistant("", tool_calls=[call]), "done"]),
        system_prompt="hi",
        tools=[look_up],
        memory=False,
        guards=GuardConfig(run_timeout_s=0.5),
    )
    agent.handle_sync("s-killed", "u1", "where is my booking AB12?")
    """
)


def _keel(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "keel", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ),
    )


def _json(result: subprocess.CompletedProcess[str]) -> dict[str, object]:
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout.strip().splitlines()[-1])
    assert isinstance(payload, dict)
    return payload


def test_a_run_killed_by_sigkill_is_listed_as_abandoned() -> None:
    worker = subprocess.run(
        [sys.executable, "-c", _WORKER], capture_output=True, text=True, timeout=120
    )
    assert worker.returncode == -9, worker.stderr
    # abandon_after_s(0.5) is 1 s of silence: wait it out.
    time.sleep(1.5)
    listed = _json(_keel("runs", "list", "--json"))
    runs = listed["runs"]
    assert isinstance(runs, list) and len(runs) == 1
    assert runs[0]["status"] == "abandoned" and runs[0]["time_limit_s"] == 0.5
    assert _json(_keel("runs", "list", "--status", "abandoned", "--json"))["count"] == 1
    assert _json(_keel("runs", "list", "--status", "running", "--json"))["count"] == 0
    shown = _json(_keel("runs", "show", str(runs[0]["run_id"]), "--json"))
    assert shown["run"]["status"] == "abandoned"  # type: ignore[index]
    plain = _keel("runs", "list")
    assert plain.returncode == 0 and "abandoned" in plain.stdout and "running" not in plain.stdout
    stats = _json(_keel("runs", "stats", "--json"))
    (session,) = stats["sessions"]  # type: ignore[misc]
    assert session["session_id"] == "s-killed" and session["abandoned_runs"] == 1
    assert any("abandoned" in warning for warning in session["warnings"])


def test_runs_list_counts_the_steps_the_reply_counts(tmp_path: Path) -> None:
    @tool
    def search(city: str) -> str:
        """Search flights."""
        return f"flights to {city}"

    def policy(call: ScriptedCall) -> Message | str:
        done = sum(1 for m in call.messages if m.role == "tool")
        if done < 4:
            city = ("Oslo", "Rome", "Lima", "Pune")[done]
            arguments = json.dumps({"city": city})
            return Message.assistant(
                "", tool_calls=[ToolCall(id=f"c{done}", name="search", arguments=arguments)]
            )
        return "Here are your flights."

    agent = Agent.embedded(
        ScriptedModel(policy),
        system_prompt="hi",
        tools=[search],
        memory=False,
        guards=GuardConfig(),
    )
    try:
        reply = agent.handle_sync("s-steps", "u1", "find me flights")
    finally:
        agent.close()
    assert reply.status == "completed" and reply.steps == 5
    (run,) = _json(_keel("runs", "list", "--json"))["runs"]  # type: ignore[misc]
    assert run["model_calls"] == reply.steps and run["tool_calls"] == 4
    assert run["step_count"] > reply.steps  # the trace also holds tool and other records
    table = _keel("runs", "list").stdout.splitlines()
    header = table[0].split()
    assert header[header.index("steps") + 1] == "tools"
    row = next(line for line in table if str(run["run_id"])[:12] in line).split()
    tokens = next(index for index, cell in enumerate(row) if "/" in cell)  # "in/out"
    assert row[tokens - 2 : tokens] == [str(reply.steps), "4"]


def test_a_cut_off_model_reply_is_traced_with_its_tokens_and_output() -> None:
    """Local and OpenAI models raise TruncatedResponseError(raw=<the partial Completion>) on
    finish_reason=length: the trace must keep its usage and text, not ``0->0 tok``."""
    partial = Completion(
        message=Message.assistant("The capital of Norway is"),
        finish_reason="length",
        usage=Usage(prompt_tokens=120, completion_tokens=64),
        model="local:smollm2",
        latency_ms=900.0,
    )
    cut = TruncatedResponseError(
        "the answer was cut at max_tokens=64 (finish_reason=length)",
        model="local:smollm2",
        raw=partial,
    )
    agent = Agent.embedded(
        ScriptedModel([cut, "Oslo."]), system_prompt="hi", memory=False, guards=GuardConfig()
    )
    try:
        reply = agent.handle_sync("s-cut", "u1", "capital of Norway?")
        assert reply.status == "completed" and reply.steps == 2
    finally:
        agent.close()
    (run,) = _json(_keel("runs", "list", "--json"))["runs"]  # type: ignore[misc]
    assert run["prompt_tokens"] >= 120 and run["completion_tokens"] >= 64  # spent, and counted
    steps = _json(_keel("runs", "show", str(run["run_id"]), "--json"))["steps"]
    assert isinstance(steps, list)
    model_steps = [step for step in steps if step["kind"] == "model"]
    first = model_steps[0]
    assert first["error_type"] == "TruncatedResponseError"
    assert (first["prompt_tokens"], first["completion_tokens"]) == (120, 64)
    assert first["raw_output"] == "The capital of Norway is"
    assert first["finish_reason"] == "length"
