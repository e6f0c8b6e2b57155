"""A sync tool's thread hands a short call's outcome back without a trip through the loop,
and a call still running is awaited as before (its time limit and cancellation hold).

The order is forced, never left to the scheduler: the thread's wake-up is held until the call
has ended (the short case) or the call waits on an event (the long one)."""

from __future__ import annotations

import asyncio
import contextvars
import os
import resource
import threading
import time
from collections.abc import Callable, Iterator

import pytest

import keel._bridge as bridge
from keel._bridge import run_in_thread
from keel.tools import tool

_seen: contextvars.ContextVar[str] = contextvars.ContextVar("seen", default="unset")


@pytest.fixture
def ended_before_the_caller_looks(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each call given to an own thread has ended before ``give`` returns (as when the woken
    thread runs it while its waker waits for the GIL)."""
    give, finish = bridge._OwnThread.give, bridge._Job.finish
    ended = threading.Condition()

    def finish_and_tell(job: bridge._Job, outcome: bridge._Outcome) -> None:
        finish(job, outcome)
        with ended:
            ended.notify_all()

    def give_and_wait(thread: bridge._OwnThread, job: bridge._Job) -> None:
        give(thread, job)
        with ended:
            assert ended.wait_for(lambda: job.outcome is not None, 10)

    monkeypatch.setattr(bridge._Job, "finish", finish_and_tell)
    monkeypatch.setattr(bridge._OwnThread, "give", give_and_wait)
    yield


@tool
def where(label: str) -> str:
    """Say which thread ran the call, with the context's value.

    Args:
        label: Echoed back.
    """
    return f"{label} {_seen.get()} {threading.current_thread().name}"


async def test_a_call_ended_by_then_returns_without_waiting_on_the_loop(
    ended_before_the_caller_looks: None,
) -> None:
    ran: list[str] = []
    asyncio.get_running_loop().call_soon(ran.append, "the loop's next callback")
    _seen.set("carried")
    result = await where.ainvoke(where.args_model(label="a"))
    # Returned before the loop ran anything else: no wait on a future, no wake-up of the loop.
    assert ran == []
    assert result.startswith("a carried keel-thread"), result
    await asyncio.sleep(0)
    assert ran == ["the loop's next callback"]


async def test_an_exception_of_a_call_ended_by_then_is_raised_as_it_was(
    ended_before_the_caller_looks: None,
) -> None:
    def fails() -> None:
        raise LookupError("no such record")

    with pytest.raises(LookupError, match="no such record"):
        await run_in_thread(fails)


async def test_a_call_still_running_is_awaited_and_its_time_limit_holds() -> None:
    """The call blocks (releasing the GIL): the caller waits on the loop, its timeout ends the
    wait, and the call's late outcome goes to ``on_abandoned``, not to the caller."""
    release = threading.Event()
    late: list[tuple[bool, object]] = []
    reported = threading.Event()

    def report(ok: bool, value: object) -> None:
        late.append((ok, value))
        reported.set()

    def blocks() -> str:
        release.wait(10)
        return "too late"

    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await run_in_thread(blocks, on_abandoned=report)
    assert late == []
    release.set()
    while not reported.is_set():  # delivered on the loop, once the thread has ended
        await asyncio.sleep(0.01)
    assert late == [(True, "too late")]


async def test_a_call_still_running_delivers_its_outcome_once_it_ends() -> None:
    started, release = threading.Event(), threading.Event()

    def waits() -> str:
        started.set()
        release.wait(10)
        return "answered"

    pending = asyncio.ensure_future(run_in_thread(waits))
    while not started.is_set():
        await asyncio.sleep(0.01)
    assert not pending.done()
    release.set()
    assert await pending == "answered"


def _run_on(pool: bridge._OwnThreads, call: Callable[[], object]) -> bridge._Job:
    job = bridge._Job(lambda: (True, call()))
    pool.submit(job)
    return job


def _ended(job: bridge._Job) -> bool:
    for _ in range(1000):  # at most 10 s, for a call that returns at once
        if job.outcome is not None:
            return True
        time.sleep(0.01)
    return False


def test_a_thread_idle_for_its_time_ends_and_the_next_call_starts_another() -> None:
    pool = bridge._OwnThreads(idle_s=0.01)
    first = _run_on(pool, threading.current_thread)
    assert _ended(first)
    for _ in range(1000):
        with pool._lock:
            if not pool._idle:
                break
        time.sleep(0.01)
    assert pool._idle == []  # retired, its socket pair closed
    second = _run_on(pool, threading.current_thread)
    assert _ended(second)
    assert first.outcome is not None and second.outcome is not None
    assert first.outcome[1] is not second.outcome[1]  # another thread (an ident may repeat)


def test_a_thread_woken_through_a_descriptor_past_1024_still_runs_its_calls() -> None:
    """A busy server holds many descriptors: the thread's socket pair may be numbered past
    select()'s limit of 1024, and is waited on without select()."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"this process may open at most {hard} descriptors")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held: list[int] = []
    try:
        while not held or held[-1] < 1030:
            held.append(os.open(os.devnull, os.O_RDONLY))
        pool = bridge._OwnThreads()
        job = _run_on(pool, lambda: "ran")
        assert _ended(job)
        assert job.outcome == (True, "ran")
    finally:
        for descriptor in held:
            os.close(descriptor)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_out_of_descriptors_a_thread_is_woken_through_a_queue_and_runs_its_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every call in flight holds a thread, each with a socket pair: a server at its limit of
    open files still runs the next call (a slower wake-up), never refuses it."""

    def no_descriptors_left() -> tuple[object, object]:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(bridge.socket, "socketpair", no_descriptors_left)
    pool = bridge._OwnThreads(idle_s=0.01)
    job = _run_on(pool, lambda: "ran")
    assert _ended(job)
    assert job.outcome == (True, "ran")
    again = _run_on(pool, lambda: "again")  # reused while idle, or retired and started anew
    assert _ended(again) and again.outcome == (True, "again")
