"""The demo's worker process: one agent (``Agent.open`` on a URL), driven over stdin/stdout.

Commands arrive as JSON lines (``{"op": "say", "text": ...}``, ``{"op": "settle"}`` or
``{"op": "resume"}``); each answer is one JSON line. The parent kills this process with SIGKILL
inside a booking and starts another one, which settles the in-doubt booking the way an operator
would (from the airline's records) and resumes the interrupted turn from the last checkpoint.
``--no-journal`` runs the agent without its durable journal: the control that shows the demo
can fail.
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
from keel.demo._flights import (
    RULES,
    SYSTEM_PROMPT,
    Airline,
    demo_machine,
    flight_tools,
    policy_model,
)
from keel.demo._junk import PROMPTED_FILE, PromptRecorder
from keel.memory import MemoryFilter, Scope
from keel.models import resolve_model
from keel.runtime._agent import Agent
from keel.settings import load_settings
from keel.testing import ScriptedModel
from keel.tools import ToolJournal

SESSION = "demo-session"
USER = "demo-user"
SCRIPTED_WINDOW_BUDGET = 8_000
"""The scripted policy reports a 128k-token model; the demo gives it an 8k working budget so
that summarization, pruning and the flat prompt are visible within a few hundred turns."""


def build_agent(
    workdir: Path,
    model_spec: str,
    *,
    memory: bool,
    journal: bool = True,
    database: str | None = None,
    redis_url: str | None = None,
) -> Agent:
    """The flight agent on ``database`` (default: ``keel.db`` in ``workdir``), opened by
    [`Agent.open`][]: state, journal, traces and memory there, state on ``redis_url`` if set.

    ``journal=False``: no durable tool journal (the executor falls back to one in this
    process's memory, which a SIGKILL loses).
    """
    airline = Airline(workdir / "airline.db")
    settings = load_settings()  # this process's edge: read once, for the model and the stores
    budget: ContextBudget | None = None
    if model_spec == "scripted":
        model: Any = ScriptedModel(policy_model, model="gpt-4o-mini")
        budget = ContextBudget(working_budget=SCRIPTED_WINDOW_BUDGET)
    else:
        model = resolve_model(model_spec, settings)
    agent = Agent.open(
        database or f"sqlite:///{workdir / 'keel.db'}",
        redis_url=redis_url or "",
        model=model,
        system_prompt=SYSTEM_PROMPT,
        rules=RULES,
        tools=flight_tools(airline, stall_file=workdir / "stall", stalled_file=workdir / "stalled"),
        machine=demo_machine(),
        memory=memory,
        journal=journal,
        context=budget,
        name="flight-demo",
        settings=settings,
    )
    return agent


def stored_memories(agent: Agent) -> dict[str, Any]:
    """Every record in the agent's memory store (the demo has one user), for the audit."""
    if agent.memory is None:
        return {"records": [], "total": 0}
    store = agent.memory.store
    total = store.count()
    everything = MemoryFilter(include_superseded=True, include_expired=True)
    records = store.list_records(
        Scope(tenant_id=agent.tenant_id, user_id=USER),
        everything,
        limit=total + 1,
        newest_first=False,
    )
    return {
        "records": [{"id": r.id, "kind": r.kind, "type": r.type, "text": r.text} for r in records],
        "total": total,
    }


def settle_in_doubt_bookings(journal: ToolJournal | None, airline: Airline) -> list[str]:
    """What an operator does after a crash: check each in-doubt booking with the airline (by
    its request key) and record the real outcome, so the resumed turn gets it instead of
    booking again. Returns the settled keys."""
    if journal is None:
        return []
    settled = []
    for entry in journal.in_doubt():
        if entry.tool != "book_flight":
            continue  # idempotent tools are simply run again on resume
        reference = airline.booking_for_request(entry.key)
        if reference is not None:
            journal.resolve(entry.key, ok=True, content=reference)
        else:
            journal.resolve(
                entry.key,
                ok=False,
                content="Error: the airline has no booking for this call; nothing was booked.",
            )
        settled.append(entry.key)
    return settled


async def serve(
    workdir: Path,
    model_spec: str,
    *,
    memory: bool,
    journal: bool,
    database: str | None = None,
    redis_url: str | None = None,
) -> None:
    agent = build_agent(
        workdir,
        model_spec,
        memory=memory,
        journal=journal,
        database=database,
        redis_url=redis_url,
    )
    recorder = PromptRecorder(workdir / PROMPTED_FILE)
    recorder.install(agent)
    airline = Airline(workdir / "airline.db")
    print(json.dumps({"op": "ready"}), flush=True)
    try:
        while True:
            line = await asyncio.to_thread(sys.stdin.readline)
            if not line:
                return
            command = json.loads(line)
            if command["op"] == "say":
                reply = await agent.handle(SESSION, USER, command["text"])
            elif command["op"] == "settle":
                keys = settle_in_doubt_bookings(agent.journal, airline)
                print(json.dumps({"op": "settled", "keys": keys}), flush=True)
                continue
            elif command["op"] == "memories":
                stored = await asyncio.to_thread(stored_memories, agent)
                print(json.dumps({"op": "memories", **stored}), flush=True)
                continue
            elif command["op"] == "resume":
                resumed = await agent.resume(SESSION, USER)
                if resumed is None:
                    print(json.dumps({"op": "nothing_to_resume"}), flush=True)
                    continue
                reply = resumed
            else:
                return
            if agent.memory is not None:
                # The turn is in memory before the next one retrieves: what a turn recalls
                # (and so its prompt) is the same in every run, not a race with the embedder.
                await agent.memory.aflush()
            print(json.dumps({"op": "reply", **reply.model_dump(mode="json")}), flush=True)
    finally:
        recorder.close()
        await agent.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--model", default="scripted")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--no-journal", action="store_true")
    parser.add_argument("--database", default=None, help="Database URL (default: workdir).")
    parser.add_argument("--redis-url", default=None, help="Redis URL for state.")
    args = parser.parse_args()
    # Guard warnings go to a log file; the parent owns the terminal.
    logging.basicConfig(
        filename=str(args.workdir / "worker.log"), level=logging.WARNING, force=True
    )
    asyncio.run(
        serve(
            args.workdir,
            args.model,
            memory=not args.no_memory,
            journal=not args.no_journal,
            database=args.database,
            redis_url=args.redis_url,
        )
    )


if __name__ == "__main__":
    main()
