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

import asyncio
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from keel.bench._react import ANSWER, question, react_agent
from keel.bench._stats import sqlite_file_bytes
from keel.context import ContextBudget
from keel.testing.servers import postgres_server
from keel.tokens import counter_for

__all__ = ["run_integrations_bench"]


async def _drive(
    session: Any,
    turns: int,
    seed: int,
    progress: Callable[[str], None] | None,
    input_filter: Any = None,
) -> Any:
    from agents import Agent, RunConfig, Runner, function_tool, set_tracing_disabled

    # The openai-agents extra: the SDK's scripted model.
    from keel.testing.openai_agents import LooksUpThenAnswers

    set_tracing_disabled(True)

    sizes = random.Random(seed)

    @function_tool
    def lookup(item: str) -> str:
        """Look an item up.

        Args:
            item: what to look up.
        """
        # Real tools answer with very different sizes: 20 to 250 lines (~80 to ~2,500 tokens).
        lines = sizes.randint(20, 250)
        return f"records for {item}: " + "a detail line about the item and its history " * lines

    model = LooksUpThenAnswers()
    inputs = model.inputs
    agent = Agent(name="helper", instructions="You look things up.", model=model, tools=[lookup])
    started = time.perf_counter()
    for turn in range(turns):
        await Runner.run(
            agent,
            f"Turn {turn}: what about item {turn:05d}?",
            session=session,
            run_config=RunConfig(call_model_input_filter=input_filter),
        )
        if progress is not None and (turn + 1) % 200 == 0:
            progress(f"{type(session).__name__}: {turn + 1}/{turns} turns")
    return inputs, time.perf_counter() - started


def _figures(
    inputs: list[list[dict[str, Any]]], elapsed: float, turns: int, limit: int, counter: Any
) -> dict[str, Any]:
    from keel.testing.openai_agents import orphaned_outputs, text_tokens  # openai-agents extra

    per_call = [text_tokens(items, counter) for items in inputs]
    per_turn = [max(per_call[2 * t], per_call[2 * t + 1]) for t in range(turns)]
    return {
        "turns": turns,
        "model_calls": len(inputs),
        "orphans": sum(len(orphaned_outputs(items)) for items in inputs),
        "calls_with_orphans": sum(1 for items in inputs if orphaned_outputs(items)),
        "overflows": sum(1 for tokens in per_call if tokens > limit),
        "prompt_tokens_t100": per_turn[min(99, turns - 1)],
        "prompt_tokens_t1000": per_turn[-1],
        "prompt_tokens_max": max(per_turn),
        "turns_per_s": round(turns / elapsed, 1),
    }


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

    from keel.integrations.langgraph import KeelCheckpointSaver  # the langgraph extra

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
    from agents import SQLiteSession
    from agents.memory import SessionSettings

    from keel.integrations.openai_agents import KeelSession  # the openai-agents extra

    counter = counter_for("gpt-4o")
    with tempfile.TemporaryDirectory(prefix="keel-bench-integrations-") as name:
        folder = Path(name)
        langgraph = (
            _langgraph_half(langgraph_steps, folder, conformance, progress)
            if langgraph_steps
            else None
        )
        if not turns:
            return {"openai_agents": None, "langgraph": langgraph, "seed": seed}
        keel = KeelSession(
            "bench",
            database=f"sqlite:///{folder / 'keel.db'}",
            model="gpt-4o",
            budget=ContextBudget(working_budget=window),
        )
        # What a prompt may take: the window less the answer's reserve (keel's default share).
        limit = keel.engine.budget.limit
        sdk = SQLiteSession(
            "bench", folder / "sdk.db", session_settings=SessionSettings(limit=sdk_limit)
        )
        sdk_inputs, sdk_s = asyncio.run(_drive(sdk, turns, seed, progress))
        keel_inputs, keel_s = asyncio.run(
            _drive(keel, turns, seed, progress, input_filter=keel.input_filter)
        )
    return {
        "openai_agents": {
            "window": window,
            "prompt_limit": limit,
            "keel": _figures(keel_inputs, keel_s, turns, limit, counter),
            "sqlite_session": {
                "limit_items": sdk_limit,
                **_figures(sdk_inputs, sdk_s, turns, limit, counter),
            },
        },
        "langgraph": langgraph,
        "seed": seed,
    }
