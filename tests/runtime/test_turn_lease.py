"""A turn's lease on its session is renewed by a timer on the event loop: a turn shorter than a
third of the lease's time to live (nearly every one) starts no task for it, and a longer one is
still renewed every third of it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from keel.stores import SQLiteDatabase
from keel.testing import ScriptedModel
from tests.runtime.conftest import sqlite_agent
from tests.runtime.test_turn_commits import _agent


async def test_a_short_turn_starts_no_task_for_its_lease(tmp_path: Path) -> None:
    agent = _agent(tmp_path)
    try:
        await agent.handle("s1", "u1", "warm up")
        loop = asyncio.get_running_loop()
        started: list[str] = []

        def factory(loop: asyncio.AbstractEventLoop, coro: Any, **options: Any) -> Any:
            started.append(getattr(coro, "__qualname__", repr(coro)))
            return asyncio.Task(coro, loop=loop, **options)

        loop.set_task_factory(factory)
        try:
            reply = await agent.handle("s1", "u1", "find the record")
        finally:
            loop.set_task_factory(None)
        assert reply.status == "completed"
        # Before: a heartbeat task, and the task of its wait for the turn's end, every turn.
        assert [name for name in started if name.startswith(("Lease.", "Event."))] == []
    finally:
        await agent.aclose()


async def test_a_long_turn_still_renews_its_lease(tmp_path: Path) -> None:
    database = SQLiteDatabase(tmp_path / "lease.db")
    # A lease of 0.15 s renewed every 0.05 s; the model takes 0.3 s to answer.
    agent = sqlite_agent(database, ScriptedModel(["Noted."], delay_s=0.3), lease_ttl_s=0.15)
    lock = agent.state.session_lock(agent.session_key("s1"), ttl=0.15)
    renewals = 0

    class Counting(type(lock)):  # type: ignore[misc]
        async def aacquire(self, wait: float = 0.0) -> bool:
            nonlocal renewals
            if self.held:
                renewals += 1
            return bool(await super().aacquire(wait))

    lock.__class__ = Counting
    agent.state.session_lock = lambda key, ttl=30.0: lock  # type: ignore[method-assign]
    try:
        reply = await agent.handle("s1", "u1", "hello")
        assert reply.status == "completed"
        assert renewals >= 1
        assert not lock.held  # given back at the end
    finally:
        await agent.aclose()
        database.close()
