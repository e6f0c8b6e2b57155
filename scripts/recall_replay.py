"""Replay a memory-on ``keel bench turns`` session's recalls, to compare two checkouts.

    PYTHONPATH=src python scripts/recall_replay.py record DIR
    PYTHONPATH=src python scripts/recall_replay.py replay DIR [PASSES]
    PYTHONPATH=src python scripts/recall_replay.py locomo DATA.json
    PYTHONPATH=src python scripts/recall_replay.py prompts TURNS

``record`` runs the bench's 1,000-turn memory-on session into DIR and keeps every
``Memory.aretrieve`` call's arguments (``calls.pkl``). ``replay`` copies DIR's database and
runs the recalls of turns 201-300 (nothing recalled: the window holds the session) and
901-1000 (ten hits) again with ``now`` fixed: per group, a hash of what they return (the same
on two checkouts when their searches find the same), the best thread CPU a recall over
PASSES passes, and SQL statements a recall (FTS5's own statements not counted). Run it with
``PYTHONPATH`` on one checkout's ``src`` then another's, alternating; for instructions, run
``late`` under ``valgrind --tool=callgrind`` with PASSES 0 and 2 and halve the difference over
100. ``locomo`` runs ``keel bench locomo --json`` with record ids from one seeded generator and
memory's clock frozen, so that two runs of one commit give the same figures. ``prompts`` runs
the bench's memory-on session (record ids from one seeded generator, memory's clock frozen, the
outbox flushed after each turn) and prints a hash of every model call's messages: the same on
two checkouts whose turns send the same prompts (run it with ``PYTHONHASHSEED=0``).
"""

from __future__ import annotations

import hashlib
import pickle
import random
import shutil
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

NOW = datetime(2026, 12, 8, tzinfo=UTC)
GROUPS = {"early": range(200, 300), "late": range(900, 1000)}


def record(directory: Path) -> None:
    from keel.bench import turns
    from keel.memory import Memory

    calls: list[tuple[str, dict[str, Any]]] = []
    original = Memory.aretrieve

    async def kept(self: Memory, query: str, **options: Any) -> Any:
        calls.append((query, options))
        return await original(self, query, **options)

    Memory.aretrieve = kept  # type: ignore[method-assign]
    turns._keel(1000, 100, directory, memory=True)
    (directory / "calls.pkl").write_bytes(pickle.dumps(calls))


def replay(directory: Path, passes: int, groups: dict[str, range] = GROUPS) -> None:
    from keel.settings import load_settings
    from keel.stores import Backends, SQLiteDatabase

    calls = pickle.loads((directory / "calls.pkl").read_bytes())
    copy = Path(tempfile.mkdtemp()) / "keel"
    shutil.copytree(directory / "keel", copy)
    backends = Backends.open(None, settings=load_settings(data_dir=copy, embedder="hashing:256"))
    memory = backends.memory
    assert memory is not None
    memory.indexer.stop()
    counted = {"statements": 0}

    def count(sql: str) -> None:
        if not sql.startswith("--"):  # FTS5's own statements
            counted["statements"] += 1

    connection = SQLiteDatabase.connection

    def traced(self: SQLiteDatabase) -> Any:
        conn = connection(self)
        conn.set_trace_callback(count)
        return conn

    SQLiteDatabase.connection = traced  # type: ignore[method-assign]
    for name, turns in groups.items():
        digest = hashlib.sha256()
        for query, options in (calls[i] for i in turns):  # a warm-up pass, hashed
            digest.update(repr(memory.retrieve(query, **options, now=NOW).model_dump()).encode())
        best = float("inf")
        for _ in range(passes):
            counted["statements"] = 0
            started = time.thread_time()
            for query, options in (calls[i] for i in turns):
                memory.retrieve(query, **options, now=NOW)
            best = min(best, (time.thread_time() - started) * 1000 / len(turns))
        statements = counted["statements"] / len(turns) if passes else 0
        print(f"{name}: {digest.hexdigest()[:16]} best {best:.3f} ms, {statements:.1f} statements")
    backends.close()


def _seeded() -> None:
    """Record ids from one seeded generator and memory's clock frozen."""
    ids = random.Random(0)
    uuid.uuid4 = lambda: uuid.UUID(int=ids.getrandbits(128), version=4)
    import keel.memory._memory as memory_module
    import keel.memory._records as records_module
    import keel.memory._retrieval as retrieval_module

    frozen = datetime(2026, 12, 7, 12, tzinfo=UTC)
    for module in (memory_module, records_module, retrieval_module):
        module.utcnow = lambda: frozen  # type: ignore[attr-defined]


def locomo(data: str) -> int:
    _seeded()
    from keel.cli import main

    return main(["bench", "locomo", "--data", data, "--json"])


def prompts(turns: int) -> None:
    _seeded()
    import asyncio
    import json

    from keel.bench import _react
    from keel.runtime import Agent
    from keel.settings import load_settings
    from keel.testing import ScriptedCall, ScriptedModel
    from keel.tools import tool

    @tool
    def lookup(query: str) -> str:
        """Look records up.

        Args:
            query: What to look up.
        """
        return _react.tool_output(query)

    digest = hashlib.sha256()

    def policy(call: ScriptedCall) -> Any:
        for m in call.messages:
            calls = [(c.id, c.name, c.arguments) for c in m.tool_calls]
            digest.update(repr((m.role, m.content, m.name, calls)).encode())
        if call.messages[-1].role == "tool":
            return _react.ANSWER
        query = json.dumps({"query": call.last_user_text[-24:]})
        return ScriptedModel.tool_call("lookup", query)

    settings = load_settings(data_dir=Path(tempfile.mkdtemp()) / "keel", embedder="hashing:256")
    agent = Agent.open(
        None,
        settings=settings,
        model=ScriptedModel(policy, keep_calls=0),
        system_prompt="You answer questions from the records.",
        tools=[lookup],
        memory=True,
    )

    async def drive() -> None:
        try:
            for turn in range(turns):
                await agent.handle("bench", "user", _react.question(turn))
                assert agent.memory is not None
                await agent.memory.aflush()  # the same vectors searched, whatever the timing
        finally:
            await agent.aclose()

    asyncio.run(drive())
    print(f"prompts of {turns} turns: {digest.hexdigest()[:16]}")


if __name__ == "__main__":
    command, argument = sys.argv[1], sys.argv[2]
    if command == "record":
        record(Path(argument))
    elif command == "replay":
        replay(Path(argument), int(sys.argv[3]) if len(sys.argv) > 3 else 5)
    elif command == "prompts":
        prompts(int(argument))
    elif command == "late":
        replay(Path(argument), int(sys.argv[3]), {"late": GROUPS["late"]})
    else:
        sys.exit(locomo(argument))
