"""Where a memory-on turn's memory work runs: on SQLite, with a scope small enough, on the
event loop's own thread (each hand-off to the blocking pool is a thread switch each way, which
on a busy machine waits for a CPU), and the outbox worker is not woken by every turn's write.

Threads are observed, not timed: the store's search and write methods note the thread they ran
on.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from keel.memory import HashingEmbedder, Memory, Scope
from keel.messages import Message
from keel.runtime import Agent
from keel.state import AgentState, StateStore
from keel.stores import SQLiteDatabase, SQLiteMemoryStore, SQLStateBackend
from keel.testing import ScriptedCall, ScriptedModel
from keel.tools import tool

SCOPE = Scope(tenant_id="acme", user_id="u1")


@tool
def lookup(query: str) -> str:
    """Look records up.

    Args:
        query: What to look up.
    """
    return f"records for {query}: one entry with its details"


def _policy(call: ScriptedCall) -> Message | str:
    if call.messages[-1].role == "tool":
        return "Here is what I found."
    return ScriptedModel.tool_call("lookup", json.dumps({"query": call.last_user_text[-16:]}))


def _noting_threads(store: SQLiteMemoryStore, threads: dict[str, set[int]]) -> None:
    """Make ``store`` note, by method, the threads its searches and writes run on."""
    for name in ("keyword_search", "vector_search", "insert_many"):
        method: Callable[..., Any] = getattr(store, name)

        def noted(*args: Any, _method: Callable[..., Any] = method, _name: str = name) -> Any:
            threads.setdefault(_name, set()).add(threading.get_ident())
            return _method(*args)

        setattr(store, name, noted)


async def _turn_threads(tmp_path: Path, turns: int) -> tuple[dict[str, set[int]], Memory]:
    """The threads the last of ``turns`` memory-on turns searched and wrote memory on."""
    database = SQLiteDatabase(tmp_path / "agent.db")
    memory = Memory(SQLiteMemoryStore(database), embedder=HashingEmbedder(64))
    agent = Agent(
        ScriptedModel(_policy),
        state=StateStore(SQLStateBackend(database), AgentState),
        system_prompt="You answer questions from the records.",
        tools=[lookup],
        memory=memory,
    )
    store = memory.store
    assert isinstance(store, SQLiteMemoryStore)
    threads: dict[str, set[int]] = {}
    for turn in range(turns):
        if turn == turns - 1:
            _noting_threads(store, threads)
        question = f"Question {turn}: what do the records say about item {turn % 3}?"
        reply = await agent.handle("s1", "ada", question)
        assert reply.status == "completed" and reply.text == "Here is what I found."
        memory.process_outbox()  # the turn's vectors: the scope's index holds them
    await agent.aclose()
    database.close()
    return threads, memory


async def test_a_memory_on_turn_searches_and_writes_memory_on_the_loop_thread(
    tmp_path: Path,
) -> None:
    # The first turn's recall loads the scope's vectors (on the pool); from then on a turn's
    # recall (both of its queries) and its write of the turn's words stay on this thread.
    threads, _ = await _turn_threads(tmp_path, 4)
    here = {threading.get_ident()}
    assert threads == {"keyword_search": here, "vector_search": here, "insert_many": here}


async def test_a_scope_past_the_inline_bound_is_searched_on_the_pool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A large scope's search may take tens of milliseconds: the loop is not held that long.
    monkeypatch.setattr("keel.stores._sqlite_memory._INLINE_SEARCH_VECTORS", 2)
    threads, _ = await _turn_threads(tmp_path, 4)
    assert threading.get_ident() not in threads["keyword_search"] | threads["vector_search"]
    # Both queries still run one after the other, on one thread of the pool.
    assert threads["keyword_search"] == threads["vector_search"]


def test_adds_while_the_worker_gathers_a_batch_wake_it_only_to_fill_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("keel.memory._outbox.BATCH_WAIT_S", 3600.0)
    database = SQLiteDatabase(tmp_path / "gather.db")
    memory = Memory(
        SQLiteMemoryStore(database), embedder=HashingEmbedder(64), batch_size=5, masker=None
    )
    indexer = memory.indexer
    wakes = [0]
    wake = indexer._wake_worker

    def counted() -> None:
        wakes[0] += 1
        wake()

    monkeypatch.setattr(indexer, "_wake_worker", counted)
    memory.start()
    signal = indexer._signal
    with signal:  # the first pass (over an empty outbox) is over: the worker sleeps
        assert signal.wait_for(lambda: indexer._progress >= 1, timeout=20)
    memory.add("note number 0 about the garden", scope=SCOPE)
    with signal:  # woken by it, the worker gathers a batch
        assert signal.wait_for(lambda: indexer._gathering_from is not None, timeout=20)
    assert wakes[0] == 1
    for n in range(1, 4):
        memory.add(f"note number {n} about the garden", scope=SCOPE)
    assert wakes[0] == 1  # the gathering worker was left to wait for the batch
    memory.add("note number 4 about the garden", scope=SCOPE)
    assert wakes[0] == 2  # the batch is whole: the worker embeds it now
    with signal:
        assert signal.wait_for(lambda: memory.store.count_pending() == 0, timeout=20)
    memory.close()
    database.close()


def test_a_search_on_the_loop_thread_answers_what_overlapped_queries_do(tmp_path: Path) -> None:
    import asyncio
    from datetime import UTC, datetime

    database = SQLiteDatabase(tmp_path / "same.db")
    memory = Memory(SQLiteMemoryStore(database), embedder=HashingEmbedder(64), masker=None)
    memory.add_many(
        [
            {"text": f"User: item {i % 7} sits on shelf {i}", "session_id": "s", "turn": i}
            for i in range(60)
        ],
        scope=SCOPE,
    )
    memory.flush()
    now = datetime(2030, 1, 1, tzinfo=UTC)
    memory.search("shelf", scope=SCOPE, now=now)  # loads the scope's vectors
    assert memory.store.searches_inline(SCOPE, memory.embedder.name if memory.embedder else None)
    for query in ("where is item 3?", "shelf 12", "item 5 on a shelf"):
        inline = asyncio.run(memory.aretrieve(query, scope=SCOPE, budget_tokens=300, now=now))
        # The reference runs the keyword query on another thread while the vectors are read,
        # as a store whose queries are round trips to a server does.
        memory.store.concurrent_searches = True
        overlapped = memory.retrieve(query, scope=SCOPE, budget_tokens=300, now=now)
        del memory.store.concurrent_searches
        assert inline == overlapped and inline.items
    memory.close()
    database.close()
