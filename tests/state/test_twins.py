"""A sync method of ``StateStore`` is its async method's code run inline: in the caller's
thread, with no event loop, so it costs what a blocking call costs and works wherever a sync
call works (inside a running loop too, blocking it as any sync call does)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from keel.state import StateStore
from keel.state._twins import sync_twin
from keel.testing._state_models import CounterState
from keel.testing._state_worker import state_backend_at


def _store(tmp_path: Path) -> StateStore[CounterState]:
    return StateStore(state_backend_at(f"sqlite:///{tmp_path / 'state.db'}"), CounterState)


def test_a_sync_method_runs_in_the_calling_thread(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.create("s", CounterState())
    deciders: list[threading.Thread] = []

    def decide(state: CounterState) -> dict[str, int]:
        deciders.append(threading.current_thread())
        return {"counter": 1}

    assert store.transact("s", decide).state.counter == 1
    assert deciders == [threading.current_thread()]
    store.close()


async def test_a_sync_method_works_inside_a_running_event_loop(tmp_path: Path) -> None:
    store = _store(tmp_path)
    created = store.create("s", CounterState())
    assert store.load("s").version == created.version
    found = await store.aget("s")
    assert found is not None and found.version == created.version
    with store.lock("s", wait=0) as lease:
        assert lease.held
    await store.aclose()


class _WaitsOnALoop:
    async def aread(self) -> int:
        await asyncio.sleep(0)  # neither a backend call nor a pause: a bug in a core
        return 1

    read = sync_twin(aread)


def test_a_core_that_waits_on_a_loop_fails_loudly_in_its_sync_twin() -> None:
    with pytest.raises(RuntimeError, match="waited on an event loop"):
        _WaitsOnALoop().read()
