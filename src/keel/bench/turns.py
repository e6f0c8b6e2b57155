"""``keel bench turns``: the runtime's own cost per turn over one long session, versus LangGraph.

Workload: one session of ``turns`` turns. In each, the user asks a question, the model calls
one tool, the tool answers and the model answers (two model calls, one tool call). The model
is a zero-latency scripted policy, so what is timed is the runtime itself: state, context,
journal and traces. keel runs as ``Agent.embedded`` (one SQLite file); LangGraph runs its
prebuilt ReAct agent with ``SqliteSaver`` and a chat model that plays the same policy.

Figures: the median and p95 of each ``bucket`` turns, ``flatness`` (the last bucket's median
over the first's: 1.0 is a runtime whose cost does not grow with the session), p50/p95 over
all turns, turns per second, the process's CPU time per turn (``cpu_ms_per_turn``: every
thread's, the memory outbox's background embedding included; on a machine shared with other
work it moves far less than the wall-clock figures do), and the database's bytes counted from
the files on disk. Every turn's reply is checked, and the tool's executions are counted from
the tool itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from keel.bench._react import ANSWER as _ANSWER
from keel.bench._react import question as _question
from keel.bench._react import react_agent
from keel.bench._react import tool_output as _tool_output
from keel.bench._stats import nearest_rank, sqlite_file_bytes
from keel.messages import Message
from keel.runtime import Agent
from keel.settings import load_settings
from keel.testing import ScriptedCall, ScriptedModel
from keel.testing.servers import postgres_server
from keel.tools import tool

__all__ = ["run_turns_bench"]


def _bucket_figures(p50s: list[float], p95s: list[float], times_ms: list[float]) -> dict[str, Any]:
    """The buckets' medians and p95s, the flatness they show, and p50/p95 over ``times_ms``."""
    return {
        "buckets_ms_p50": p50s,
        "buckets_ms_p95": p95s,
        "flatness": round(p50s[-1] / p50s[0], 3) if p50s and p50s[0] > 0 else None,
        "p50_ms": round(statistics.median(times_ms), 3),
        "p95_ms": round(nearest_rank(times_ms, 0.95), 3),
    }


def _summary(times_ms: list[float], bucket: int, elapsed_s: float) -> dict[str, Any]:
    buckets = [times_ms[i : i + bucket] for i in range(0, len(times_ms), bucket)]
    p50s = [round(statistics.median(part), 3) for part in buckets if part]
    p95s = [round(nearest_rank(part, 0.95), 3) for part in buckets if part]
    return {
        **_bucket_figures(p50s, p95s, times_ms),
        "turns_per_s": round(len(times_ms) / elapsed_s, 2) if elapsed_s > 0 else None,
    }


def _postgres_bytes(url: str) -> int:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT pg_database_size(current_database())").fetchone()
    return int(row[0]) if row else 0


async def _earlier_session(agent: Agent, turns: int) -> None:
    """The user's earlier session, untimed: memory holds its turns (embedded) before the
    timed session starts, so that session's first turns have something to recall too."""
    for turn in range(turns):
        reply = await agent.handle("earlier", "user", _question(turn))
        if reply.status != "completed":
            raise RuntimeError(f"earlier turn {turn} did not complete: {reply.error}")
    if turns and agent.memory is not None:
        await agent.memory.aflush()


def _keel(
    turns: int,
    bucket: int,
    directory: Path,
    *,
    memory: bool,
    postgres_url: str | None = None,
    name: str = "keel",
    earlier_turns: int = 0,
) -> dict[str, Any]:
    executions = {"count": 0}

    @tool
    def lookup(query: str) -> str:
        """Look records up.

        Args:
            query: What to look up.
        """
        executions["count"] += 1
        return _tool_output(query)

    def policy(call: ScriptedCall) -> Message | str:
        if call.messages[-1].role == "tool":
            return _ANSWER
        return ScriptedModel.tool_call("lookup", json.dumps({"query": call.last_user_text[-24:]}))

    data_dir = directory / name
    settings = load_settings(data_dir=data_dir, embedder="hashing:256")
    empty_bytes = _postgres_bytes(postgres_url) if postgres_url is not None else 0
    agent = Agent.open(
        postgres_url,
        settings=settings,
        # The policy reads the call it is given: no prompt is kept (keeping a thousand turns'
        # prompts would time the garbage collector's ever longer full passes, not keel).
        model=ScriptedModel(policy, keep_calls=0),
        system_prompt="You answer questions from the records.",
        tools=[lookup],
        memory=memory,
    )
    times: list[float] = []
    cpu = {"seconds": 0.0}

    async def drive() -> float:
        # Closed on this loop: the PostgreSQL pools the agent opened belong to it.
        try:
            await _earlier_session(agent, earlier_turns)
            executions["count"] = 0
            started = time.perf_counter()
            cpu_started = time.process_time()
            for turn in range(turns):
                before = time.perf_counter()
                reply = await agent.handle("bench", "user", _question(turn))
                times.append((time.perf_counter() - before) * 1000)
                if reply.status != "completed" or reply.text != _ANSWER:
                    raise RuntimeError(
                        f"turn {turn} did not complete: {reply.status} {reply.error}"
                    )
            cpu["seconds"] = time.process_time() - cpu_started
            return time.perf_counter() - started
        finally:
            await agent.aclose()

    elapsed = asyncio.run(drive())
    if executions["count"] != turns:
        raise RuntimeError(f"the tool ran {executions['count']} times for {turns} turns")
    figures = _summary(times, bucket, elapsed)
    figures["cpu_ms_per_turn"] = round(cpu["seconds"] * 1000 / max(turns, 1), 3)
    if postgres_url is not None:
        # What the session added to the database, counted by the server.
        figures["db_bytes"] = _postgres_bytes(postgres_url) - empty_bytes
    else:
        database = settings.sqlite_path
        assert database is not None
        figures["db_bytes"] = sqlite_file_bytes(database)
    figures["tool_executions"] = executions["count"]
    figures["times_ms"] = times
    return figures


def _langgraph(turns: int, bucket: int, directory: Path) -> dict[str, Any]:
    import sqlite3

    from langgraph.checkpoint.sqlite import SqliteSaver

    path = directory / "langgraph.db"
    conn = sqlite3.connect(path, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    graph, executions = react_agent(SqliteSaver(conn))
    config = {"configurable": {"thread_id": "bench"}}
    times: list[float] = []
    started = time.perf_counter()
    try:
        for turn in range(turns):
            before = time.perf_counter()
            out = graph.invoke({"messages": [("user", _question(turn))]}, config)
            times.append((time.perf_counter() - before) * 1000)
            if out["messages"][-1].content != _ANSWER:
                raise RuntimeError(f"LangGraph turn {turn} did not answer")
        elapsed = time.perf_counter() - started
    finally:
        conn.close()
    if executions["count"] != turns:
        raise RuntimeError(f"LangGraph's tool ran {executions['count']} times for {turns} turns")
    figures = _summary(times, bucket, elapsed)
    figures["db_bytes"] = sqlite_file_bytes(path)
    return figures


def _combined(runs: list[dict[str, Any]], bucket: int) -> dict[str, Any]:
    """Figures of several sessions of the same workload: per bucket, the median of the runs'
    medians (a run on a shared machine has slow spells that are the machine's, not the
    session's); p50 and p95 over every turn of every run; the median run's turns/s."""
    if len(runs) == 1:
        figures = dict(runs[0])
        figures.pop("times_ms")
        return figures
    p50s = [
        round(statistics.median(run["buckets_ms_p50"][index] for run in runs), 3)
        for index in range(len(runs[0]["buckets_ms_p50"]))
    ]
    p95s = [
        round(statistics.median(run["buckets_ms_p95"][index] for run in runs), 3)
        for index in range(len(runs[0]["buckets_ms_p95"]))
    ]
    every = [time for run in runs for time in run["times_ms"]]
    cpu = [run["cpu_ms_per_turn"] for run in runs if "cpu_ms_per_turn" in run]
    return {
        **({"cpu_ms_per_turn": statistics.median(cpu)} if cpu else {}),
        **_bucket_figures(p50s, p95s, every),
        "turns_per_s": statistics.median(run["turns_per_s"] for run in runs),
        "db_bytes": runs[0]["db_bytes"],
        "tool_executions": runs[0]["tool_executions"],
        "repeats": len(runs),
        "flatness_of_each_run": [run["flatness"] for run in runs],
        "turns_per_s_of_each_run": [run["turns_per_s"] for run in runs],
    }


def _against_memory_off(on: dict[str, Any], off: dict[str, Any]) -> dict[str, Any]:
    """Memory on against memory off in the same run (p50 and CPU per turn, on / off), and the
    last bucket's median over the third's (turns 201-300 at the default bucket of 100: the
    session past its start-up) for memory on."""
    figures: dict[str, Any] = {}
    if off.get("p50_ms"):
        figures["p50_vs_memory_off"] = round(on["p50_ms"] / off["p50_ms"], 3)
    if off.get("cpu_ms_per_turn"):
        figures["cpu_vs_memory_off"] = round(on["cpu_ms_per_turn"] / off["cpu_ms_per_turn"], 3)
    buckets = on["buckets_ms_p50"]
    if len(buckets) >= 4 and buckets[2] > 0:
        figures["last_vs_third_bucket"] = round(buckets[-1] / buckets[2], 3)
    return figures


def run_turns_bench(
    *,
    turns: int = 1000,
    bucket: int = 100,
    memory: bool = True,
    langgraph: bool = True,
    database: str = "sqlite",
    repeat: int = 1,
    memory_history: int = 0,
    progress: Callable[[str], None] = lambda text: None,
) -> dict[str, Any]:
    """Run the workload on keel (memory off, and on if asked) and on LangGraph.

    ``memory_history``: also run memory on for a user whose earlier session of that many
    turns memory already holds (``memory_with_history``, with its own ratios): every turn of
    that session can recall something, where the plain memory-on session's first few hundred
    turns find nothing outside their own window. The plain figures are unchanged by it.

    ``database``: ``sqlite`` (the embedded default, one file) or ``postgres`` (a throwaway
    embedded PostgreSQL with pgvector, started here and dropped afterwards, holding state,
    journal, traces and memory; a fresh database for each keel run). ``repeat``: sessions of
    keel with memory off, each on a fresh database, combined by `_combined`."""
    if database not in ("sqlite", "postgres"):
        raise ValueError(f"database must be 'sqlite' or 'postgres', not {database!r}")
    with contextlib.ExitStack() as stack:
        folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="keel-bench-turns-"))
        directory = Path(folder)
        server = None
        if database == "postgres":
            progress("starting a throwaway PostgreSQL")
            server = stack.enter_context(postgres_server())

        def keel_run(memory_on: bool, name: str, earlier: int = 0) -> dict[str, Any]:
            if server is None:
                return _keel(
                    turns, bucket, directory, memory=memory_on, name=name, earlier_turns=earlier
                )
            with server.throwaway_database() as url:
                return _keel(
                    turns,
                    bucket,
                    directory,
                    memory=memory_on,
                    postgres_url=url,
                    name=name,
                    earlier_turns=earlier,
                )

        result: dict[str, Any] = {"turns": turns, "bucket": bucket, "database": database}
        runs = []
        for attempt in range(repeat):
            progress(f"keel on {database}, memory off: {turns} turns ({attempt + 1}/{repeat})")
            runs.append(keel_run(False, f"keel-{attempt}"))
        result.update(_combined(runs, bucket))
        if memory:
            progress(f"keel on {database}, memory on: {turns} turns")
            on = result["memory_on"] = _combined([keel_run(True, "keel-memory")], bucket)
            on.update(_against_memory_off(on, result))
            if memory_history > 0:
                progress(
                    f"keel on {database}, memory on after an earlier session of "
                    f"{memory_history} turns: {turns} turns"
                )
                held = _combined([keel_run(True, "keel-history", memory_history)], bucket)
                held.update(_against_memory_off(held, result))
                held["earlier_turns"] = memory_history
                result["memory_with_history"] = held
        if langgraph:
            progress(f"LangGraph create_react_agent + SqliteSaver: {turns} turns")
            lang = _langgraph(turns, bucket, directory)
            result["langgraph"] = lang
            if lang.get("turns_per_s") and result.get("turns_per_s"):
                result["speedup_vs_langgraph"] = round(
                    result["turns_per_s"] / lang["turns_per_s"], 2
                )
            if result["db_bytes"]:
                result["db_bytes_ratio_langgraph"] = round(lang["db_bytes"] / result["db_bytes"], 1)
    return result
