"""An agent's sync twins run on one long-lived bridge loop: the model's HTTP client is made
once and reused across ``handle_sync`` calls from any thread (a new event loop per call made,
and leaked, one client each)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest

from keel._bridge import BLOCKING_THREADS, fork, map_blocking
from keel.errors import UsageError
from keel.messages import Message
from keel.models import Completion, ModelOptions, OpenAICompatibleModel, RetryPolicy, ToolSchema
from keel.runtime import Agent
from keel.state import AgentState, StateStore
from keel.stores import SQLiteDatabase, SQLStateBackend
from keel.testing import FaultServer, ScriptedModel


def test_handle_sync_reuses_one_client(
    fault_server: FaultServer, fast_retry: RetryPolicy, tmp_path: Path
) -> None:
    model = OpenAICompatibleModel(
        "ok", base_url=fault_server.base_url, api_key="x", retry=fast_retry
    )
    database = SQLiteDatabase(tmp_path / "keel.db")
    agent = Agent(
        model,
        state=StateStore(SQLStateBackend(database), AgentState),
        system_prompt="You help.",
    )
    for turn in range(3):
        assert agent.handle_sync("s1", "u1", f"hi {turn}").status == "completed"
    replies: list[str] = []
    threads = [
        threading.Thread(
            target=lambda n=n: replies.append(agent.handle_sync(f"t{n}", "u1", "x").status)
        )
        for n in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert replies == ["completed"] * 3
    assert len(model._clients) == 1, "one client for every sync turn, from any thread"
    model.close()
    assert model._clients == {}
    database.close()


async def test_a_sync_twin_inside_a_running_loop_is_a_usage_error(tmp_path: Path) -> None:
    from keel.testing import ScriptedModel

    database = SQLiteDatabase(tmp_path / "keel.db")
    agent = Agent(
        ScriptedModel(["ok"]),
        state=StateStore(SQLStateBackend(database), AgentState),
        system_prompt="You help.",
    )
    with pytest.raises(UsageError, match="await its async twin"):
        agent.handle_sync("s1", "u1", "hi")
    database.close()


class _LoopRecordingModel(ScriptedModel):
    """Answers ``ok``, noting the event loop and the thread each call ran on."""

    def __init__(self) -> None:
        super().__init__(lambda call: "ok")
        self.ran_on: list[tuple[asyncio.AbstractEventLoop, str]] = []

    async def _acomplete(
        self, messages: Sequence[Message], tools: Sequence[ToolSchema], options: ModelOptions
    ) -> Completion:
        self.ran_on.append((asyncio.get_running_loop(), threading.current_thread().name))
        return await super()._acomplete(messages, tools, options)


def test_a_models_sync_twins_run_on_the_one_bridge_loop() -> None:
    model = _LoopRecordingModel()
    assert model.complete([Message.user("hi")]).text == "ok"
    assert model.complete([Message.user("again")]).text == "ok"
    assert "".join(chunk.text for chunk in model.stream([Message.user("more")])) == "ok"
    loops = {loop for loop, _ in model.ran_on}
    threads = {thread for _, thread in model.ran_on}
    # Not a new event loop per call: a client made for the loop serves every later call.
    assert len(model.ran_on) == 3 and len(loops) == 1 and threads == {"keel-sync-bridge"}


def test_forked_work_no_pool_thread_started_runs_in_the_thread_that_joins_it() -> None:
    # Every thread of the blocking pool busy: a fork joined now must not wait for one.
    release = threading.Event()
    started = threading.Semaphore(0)

    def hold() -> None:
        started.release()
        release.wait(60)

    holders = [fork(hold) for _ in range(BLOCKING_THREADS)]
    try:
        for _ in range(BLOCKING_THREADS):
            assert started.acquire(timeout=30), "a pool thread never started"
        joined: list[str] = []
        joiner = threading.Thread(
            target=lambda: joined.append(fork(lambda: threading.current_thread().name).join()),
            name="joiner",
        )
        joiner.start()
        joiner.join(timeout=30)
        assert joined == ["joiner"], "the join waited on a busy pool"
    finally:
        release.set()
        for holder in holders:
            holder.join()


def test_map_blocking_runs_width_calls_at_once_and_keeps_the_order() -> None:
    together = threading.Barrier(3, timeout=30)  # passes only with three calls running at once

    def square(number: int) -> tuple[int, str]:
        if number < 3:
            together.wait()
        return number * number, threading.current_thread().name

    results = map_blocking(square, list(range(8)), width=3)
    assert [value for value, _ in results] == [n * n for n in range(8)]
    threads = {thread for _, thread in results}
    assert threading.current_thread().name in threads and len(threads) <= 3
    alone = map_blocking(square, [5, 6], width=1)
    assert {thread for _, thread in alone} == {threading.current_thread().name}
