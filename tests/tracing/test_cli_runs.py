"""``keel runs`` as a user runs it, over a database filled through the Tracer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from keel.cli import main
from keel.errors import ToolExecutionError
from keel.messages import Usage
from keel.settings import load_settings
from keel.stores import Backends
from keel.tracing import Tracer


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def keel(capsys: pytest.CaptureFixture[str]) -> Callable[..., Result]:
    """Run ``keel ARGS`` in this process (fast); one test below uses a real subprocess."""

    def run(*args: str) -> Result:
        capsys.readouterr()
        code = main(list(args))
        captured = capsys.readouterr()
        return Result(code, captured.out, captured.err)

    return run


def _last_json(result: Result | subprocess.CompletedProcess[str]) -> dict[str, object]:
    assert result.returncode == 0, result.stdout + result.stderr
    payload = json.loads(result.stdout.strip().splitlines()[-1])
    assert isinstance(payload, dict)
    return payload


@pytest.fixture
def filled() -> dict[str, str]:
    """Three sessions' runs in the settings' database: short, long (>= 10 steps), failing."""
    backends = Backends.open(load_settings(), memory=False)
    store = backends.traces
    tracer = Tracer(store, agent="booker")
    ids: dict[str, str] = {}
    with tracer.start_run("s-short", user_id="u1", input="hi") as run:
        with run.step("model", "scripted:policy") as call:
            call.update(usage=Usage(prompt_tokens=50, completion_tokens=5), raw_output="hello")
        run.end(output="hello")
    ids["short"] = run.run_id

    with tracer.start_run("s-long", user_id="u1", input="book three trips") as run:
        for turn in range(5):
            with run.step("model", "scripted:policy", state_version=turn) as call:
                call.first_token()
                call.update(
                    usage=Usage(prompt_tokens=800 + 300 * turn, completion_tokens=20),
                    finish_reason="tool_calls",
                )
                with run.step(
                    "tool",
                    "search_flights",
                    tool_call_id=f"call_{turn}",
                    tool_arguments={"to": "OSL", "passengers": 2},
                ) as tool:
                    tool.update(tool_result="LIS-OSL 09:10 " * 200)
            run.transition("searching", "booking", state_version=turn + 1)
        run.end(output="booked")
    ids["long"] = run.run_id

    with pytest.raises(ToolExecutionError), tracer.start_run("s-fail", user_id="u2") as run:
        with run.step("model", "scripted:policy") as call:
            call.update(usage=Usage(prompt_tokens=120, completion_tokens=9))
        run.loop_caught(["book_flight x3 with the same arguments"])
        with run.step("tool", "book_flight", tool_arguments='{"flight": "XX1"}'):
            raise ToolExecutionError("payment service down")
    ids["fail"] = run.run_id
    backends.close()
    assert tracer.write_failures == 0
    return ids


def test_list_min_steps_finds_exactly_the_long_run(
    filled: dict[str, str], keel: Callable[..., Result]
) -> None:
    # Steps are model calls, as a reply counts them: the long run made 5 (and 5 tool calls, 5
    # transitions: 15 trace records).
    payload = _last_json(keel("runs", "list", "--min-steps", "5", "--json"))
    runs = payload["runs"]
    assert isinstance(runs, list)
    assert [r["run_id"] for r in runs] == [filled["long"]]
    assert runs[0]["model_calls"] == 5 and runs[0]["step_count"] == 15
    assert runs[0]["status"] == "succeeded"
    assert _last_json(keel("runs", "list", "--min-steps", "6", "--json"))["count"] == 0


def test_list_tool_error_finds_the_failing_run(
    filled: dict[str, str], keel: Callable[..., Result]
) -> None:
    payload = _last_json(keel("runs", "list", "--tool-error", "--json", "--since", "1h"))
    runs = payload["runs"]
    assert isinstance(runs, list)
    assert [r["run_id"] for r in runs] == [filled["fail"]]
    assert runs[0]["status"] == "failed" and runs[0]["tool_errors"] == 1
    everything = _last_json(keel("runs", "list", "--json"))
    assert everything["count"] == 3
    assert _last_json(keel("runs", "list", "--agent", "booker", "--json"))["count"] == 3
    assert _last_json(keel("runs", "list", "--agent", "nobody", "--json"))["count"] == 0
    assert _last_json(keel("runs", "list", "--status", "failed", "--json"))["count"] == 1
    bad = keel("runs", "list", "--status", "exploded")
    assert bad.returncode == 2 and "unknown status" in bad.stderr
    plain = keel("runs", "list", "--session", "s-short")
    assert plain.returncode == 0 and filled["short"][:12] in plain.stdout
    assert filled["long"][:12] not in plain.stdout


def test_show_prints_the_tree(filled: dict[str, str], keel: Callable[..., Result]) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "keel", "runs", "show", filled["long"][:10]],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ),
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert filled["long"] in out and "succeeded" in out
    assert out.count("search_flights") >= 5 and "searching->booking" in out
    assert "1100→20 tok" in out  # second call's tokens
    # Tool steps are drawn inside their model call: a deeper tree guide precedes them.
    tool_lines = [line for line in out.splitlines() if "tool search_flights" in line]
    model_lines = [line for line in out.splitlines() if "model scripted:policy" in line]
    assert len(tool_lines) == 5 and len(model_lines) == 5
    assert tool_lines[0].index("tool") > model_lines[0].index("model")

    detail = _last_json(keel("runs", "show", filled["fail"], "--json"))
    steps = detail["steps"]
    assert isinstance(steps, list)
    failed = [s for s in steps if s["error_type"] == "ToolExecutionError"]
    assert failed and failed[0]["error_message"] == "payment service down"
    assert isinstance(detail["tree"], list) and len(detail["tree"]) == 3


def test_show_unknown_run_is_one_error_line(
    filled: dict[str, str], keel: Callable[..., Result]
) -> None:
    result = keel("runs", "show", "no-such-run")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and result.stderr.strip().startswith("error:")


def test_stats_json_has_the_indicators(filled: dict[str, str], keel: Callable[..., Result]) -> None:
    payload = _last_json(keel("runs", "stats", "--json"))
    sessions = payload["sessions"]
    assert isinstance(sessions, list)
    by_id = {s["session_id"]: s for s in sessions}
    assert set(by_id) == {"s-short", "s-long", "s-fail"}
    long = by_id["s-long"]
    for key in (
        "retry_rate",
        "avg_prompt_tokens",
        "prompt_growth",
        "prompt_creeping",
        "state_resets",
        "ttft_p50_ms",
        "ttft_p95_ms",
        "loops_caught",
        "warnings",
    ):
        assert key in long
    # One run whose prompt grows call by call, no retries: the window filling, not a spiral.
    assert long["avg_prompt_tokens"] == 1400 and long["prompt_growth"] > 1.5
    assert long["prompt_creeping"] is False
    assert long["ttft_p50_ms"] is not None
    assert by_id["s-fail"]["loops_caught"] == 1
    assert long["warnings"] == [] and payload["warnings"] >= 1  # s-fail's loop
    lenient = _last_json(keel("runs", "stats", "--session", "s-fail", "--max-loops", "1", "--json"))
    assert lenient["thresholds"]["max_loops"] == 1
    assert not any("loops" in w for s in lenient["sessions"] for w in s["warnings"])
    plain = keel("runs", "stats", "--session", "s-fail")
    assert plain.returncode == 0 and "loops caught" in plain.stdout


def test_stats_counts_model_calls_as_the_viewer_does(
    filled: dict[str, str], keel: Callable[..., Result]
) -> None:
    """Model calls and tool calls are two columns, never one sum the viewer does not show."""
    plain = keel("runs", "stats", "--session", "s-long")
    header = plain.stdout.splitlines()[0]
    assert "model calls" in header and "tool calls" in header
    row = next(line for line in plain.stdout.splitlines() if line.split()[:1] == ["s-long"])
    assert row.split()[1:4] == ["1", "5", "5"]  # runs, model calls, tool calls


def test_bad_since_is_a_usage_error(keel: Callable[..., Result]) -> None:
    result = keel("runs", "list", "--since", "yesterday-ish")
    assert result.returncode == 2 and "cannot read time" in result.stderr


def test_prune_deletes_old_runs_only(filled: dict[str, str], keel: Callable[..., Result]) -> None:
    kept = _last_json(keel("runs", "prune", "--older-than", "1d", "--json"))
    assert kept["deleted_runs"] == 0
    gone = _last_json(keel("runs", "prune", "--older-than", "2099-01-01", "--json"))
    assert gone["deleted_runs"] == 3
    assert _last_json(keel("runs", "list", "--json"))["count"] == 0
