"""The demo's worker process: one agent on the embedded default, driven over stdin/stdout.

Commands arrive as JSON lines (``{"op": "say", "text": ...}`` or ``{"op": "resume"}``); each
answer is one JSON line with the turn's reply. The parent kills this process with SIGKILL in
the middle of a tool call and starts another one, which resumes from the last checkpoint.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from pathlib import Path
from typing import Any

from keel.context import ContextBudget
from keel.demo._flights import RULES, SYSTEM_PROMPT, Airline, demo_machine, flight_tools
from keel.runtime._agent import Agent
from keel.state import AgentState, StateStore
from keel.stores import SQLiteDatabase, SQLiteStateBackend, SQLiteToolJournal
from keel.tracing import Tracer

SESSION = "demo-session"
USER = "demo-user"
SCRIPTED_WINDOW_BUDGET = 8_000
"""The scripted policy reports a 128k-token model; the demo gives it an 8k working budget so
that summarization, pruning and the flat prompt are visible within a few hundred turns."""


def build_agent(workdir: Path, model_spec: str, *, memory: bool) -> tuple[Agent, Any]:
    """The flight agent on one SQLite file in ``workdir`` (state, journal, traces, memory)."""
    from keel.stores._sqlite_traces import SQLiteTraceStore

    database = SQLiteDatabase(workdir / "keel.db")
    airline = Airline(workdir / "airline.db")
    budget: ContextBudget | None = None
    if model_spec == "scripted":
        from keel.demo._flights import policy_model
        from keel.testing import ScriptedModel

        model: Any = ScriptedModel(policy_model, model="gpt-4o-mini")
        budget = ContextBudget(working_budget=SCRIPTED_WINDOW_BUDGET)
    else:
        from keel.models import resolve_model

        model = resolve_model(model_spec)
    traces = SQLiteTraceStore(database)
    traces.setup()
    long_term = None
    if memory:
        long_term = _memory(database)
    agent = Agent(
        model,
        state=StateStore(SQLiteStateBackend(database), AgentState),
        system_prompt=SYSTEM_PROMPT,
        rules=RULES,
        tools=flight_tools(airline, stall_file=workdir / "stall", stalled_file=workdir / "stalled"),
        machine=demo_machine(),
        memory=long_term,
        journal=SQLiteToolJournal(database),
        tracer=Tracer(traces, agent="flight-demo"),
        context=budget,
        name="flight-demo",
    )
    return agent, long_term


def _memory(database: SQLiteDatabase) -> Any:
    from keel.memory import Memory, default_embedder
    from keel.stores import SQLiteMemoryStore

    return Memory(SQLiteMemoryStore(database), embedder=default_embedder(), background=True)


async def serve(workdir: Path, model_spec: str, *, memory: bool) -> None:
    agent, long_term = build_agent(workdir, model_spec, memory=memory)
    print(json.dumps({"op": "ready"}), flush=True)
    try:
        while True:
            line = await asyncio.to_thread(sys.stdin.readline)
            if not line:
                return
            command = json.loads(line)
            if command["op"] == "say":
                reply = await agent.handle(SESSION, USER, command["text"])
            elif command["op"] == "resume":
                resumed = await agent.resume(SESSION, USER)
                if resumed is None:
                    print(json.dumps({"op": "nothing_to_resume"}), flush=True)
                    continue
                reply = resumed
            else:
                return
            print(json.dumps({"op": "reply", **reply.model_dump(mode="json")}), flush=True)
    finally:
        if long_term is not None:
            long_term.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--model", default="scripted")
    parser.add_argument("--no-memory", action="store_true")
    args = parser.parse_args()
    # Guard warnings go to a log file; the parent owns the terminal.
    logging.basicConfig(
        filename=str(args.workdir / "worker.log"), level=logging.WARNING, force=True
    )
    asyncio.run(serve(args.workdir, args.model, memory=not args.no_memory))


if __name__ == "__main__":
    main()
