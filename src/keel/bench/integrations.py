"""``keel bench integrations``: keel inside other frameworks, side by side with their own parts.

**LangGraph.** The same graph, LangGraph's prebuilt ReAct agent with a chat model that plays a
fixed policy, runs ``steps`` steps on one thread with LangGraph's ``SqliteSaver`` and with
keel's checkpointer on SQLite. A step is one invocation of the graph: the user's question, a
tool call, the tool's result, the answer (five checkpoints: the input, then one per super-step).
Figures: steps per second over the whole run, the database's bytes on disk (WAL folded in), the
checkpoints each stored (counted from each database's rows), and every answer and the thread's final
message count checked. LangGraph's conformance suite (``langgraph-checkpoint-conformance``) runs
against keel's checkpointer on SQLite and on a throwaway embedded PostgreSQL.

**OpenAI Agents SDK.** Workload: ``turns`` turns of one agent on one session. Each turn the user
asks about an item, the model calls ``lookup`` (its output 80 to 2,500 tokens, seeded) and then
answers: two model calls, four items. The model is a fake that records what the SDK sends it.
The same turns run through the SDK's ``SQLiteSession`` with ``SessionSettings(limit=...)`` (the
SDK's way to bound the history) and through keel's ``KeelSession`` with a ``window``-token
context budget, its input filter fitting each call's whole input (the turn in progress
included).

Counted from what the model received, per call: orphaned tool items (a ``function_call_output``
without its ``function_call`` in the same input), overflows (inputs over the window minus the
answer's reserve, counted with the model's tokenizer), and prompt tokens at turn 100 and at
the last turn.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from keel.bench._react import ANSWER, question, react_agent
from keel.bench._stats import sqlite_file_bytes
from keel.testing.servers import postgres_server

__all__ = ["run_integrations_bench"]


def _run_graph(saver: Any, steps: int, count_checkpoints: Callable[[], int]) -> dict[str, Any]:
    graph, executions = react_agent(saver)
    config = {"configurable": {"thread_id": "bench"}}
    started = time.perf_counter()
    for step in range(steps):
        out = graph.invoke({"messages": [("user", question(step))]}, config)
        if out["messages"][-1].content != ANSWER:
            raise RuntimeError(f"step {step} did not answer")
    elapsed = time.perf_counter() - started
    messages = len(graph.get_state(config).values["messages"])
    if messages != 4 * steps or executions["count"] != steps:
        raise RuntimeError(
            f"{messages} messages and {executions['count']} tool runs after {steps} steps"
        )
    return {
        "steps_per_s": round(steps / elapsed, 2),
        "seconds": round(elapsed, 2),
        "checkpoints": count_checkpoints(),
    }


def _langgraph_half(
    steps: int, folder: Path, conformance: bool, progress: Callable[[str], None] | None
) -> dict[str, Any]:
    import sqlite3

    from langgraph.checkpoint.sqlite import SqliteSaver

    # The langgraph extra (keel's saver, and LangGraph's SqliteSaver above): only this half
    # of the bench needs it, so the other halves run without it.
    from keel.integrations.langgraph import KeelCheckpointSaver

    if progress:
        progress(f"LangGraph ReAct agent, {steps} steps on one thread: SqliteSaver")
    path = folder / "langgraph.db"
    conn = sqlite3.connect(path, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")

    def sqlite_saver_checkpoints() -> int:
        row = conn.execute("SELECT COUNT(*) FROM checkpoints").fetchone()
        return int(row[0])

    try:
        theirs = _run_graph(SqliteSaver(conn), steps, sqlite_saver_checkpoints)
    finally:
        conn.close()
    theirs["bytes"] = sqlite_file_bytes(path)
    if progress:
        progress("... and keel's checkpointer")
    keel_path = folder / "keel-langgraph.db"
    with KeelCheckpointSaver(f"sqlite:///{keel_path}") as saver:
        ours = _run_graph(saver, steps, lambda: saver.count_checkpoints("bench"))
    ours["bytes"] = sqlite_file_bytes(keel_path)
    result: dict[str, Any] = {
        "steps": steps,
        "keel_steps_per_s": ours["steps_per_s"],
        "sqlite_saver_steps_per_s": theirs["steps_per_s"],
        "speedup": round(ours["steps_per_s"] / theirs["steps_per_s"], 2),
        "keel_bytes": ours["bytes"],
        "sqlite_saver_bytes": theirs["bytes"],
        "bytes_ratio": round(theirs["bytes"] / ours["bytes"], 1),
        "keel": ours,
        "sqlite_saver": theirs,
        "conformance": None,
    }
    if conformance:
        # The langgraph extra and LangGraph's conformance suite (the test extra).
        from keel.testing.langgraph import conformance_failures

        if progress:
            progress("LangGraph's conformance suite: keel on SQLite and on PostgreSQL")
        sqlite_ok = not conformance_failures(f"sqlite:///{folder / 'conformance.db'}")
        with postgres_server() as server, server.throwaway_database() as url:
            postgres_ok = not conformance_failures(url)
        result["conformance"] = {"sqlite": sqlite_ok, "postgres": postgres_ok}
    return result


def run_integrations_bench(
    *,
    turns: int = 1000,
    window: int = 16_000,
    sdk_limit: int = 50,
    seed: int = 7,
    langgraph_steps: int = 1000,
    conformance: bool = True,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Both halves: LangGraph's ``SqliteSaver`` against keel's checkpointer over
    ``langgraph_steps`` steps (0: skipped), and the SDK's ``SQLiteSession`` (``limit=sdk_limit``
    items) against keel's session (a ``window``-token budget) over ``turns`` turns (0:
    skipped)."""
    with tempfile.TemporaryDirectory(prefix="keel-bench-integrations-") as name:
        folder = Path(name)
        langgraph = (
            _langgraph_half(langgraph_steps, folder, conformance, progress)
            if langgraph_steps
            else None
        )
        if not turns:
            return {"openai_agents": None, "langgraph": langgraph, "seed": seed}
        # The openai-agents extra: the SDK and keel's session for it.
        from keel.bench._sdk_half import run_sdk_half

        openai_agents = run_sdk_half(folder, turns, window, sdk_limit, seed, progress)
    return {"openai_agents": openai_agents, "langgraph": langgraph, "seed": seed}
