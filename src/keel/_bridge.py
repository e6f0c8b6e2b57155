"""The one bridge from sync code to keel's async core.

Every sync twin (``Agent.handle_sync``, ``ChatModel.complete``, ``Memory.retrieve``, ...) runs
its coroutine on ONE long-lived event loop in a daemon thread, the blocking-portal pattern,
instead of a new event loop per call. What an async client keeps per loop (an HTTP
connection pool, a PostgreSQL or Redis async pool) is then made once and reused, not leaked
with each call's dead loop, and sync calls from several threads share one loop safely.

The other direction, async code calling a blocking function (SQLite, an ONNX embedder), goes
through `run_blocking`; sync code that overlaps blocking work (a keyword query while the
query is embedded, a batch written while the next is embedded, forward passes side by side)
forks it with `fork` or `map_blocking`. All of it runs on ONE bounded pool of named threads
owned here (``keel-blocking-N``). Work that may run far longer than its caller waits (a sync
tool that hangs past its timeout, a model's generation) goes through `run_in_thread`, a daemon
thread of its own, so that it never fills that pool. This module is the only one in keel that
starts a thread or an event loop (tests/test_async_rule.py keeps it so, with the exceptions
docs/architecture.md lists).

What a library ties to one loop for its whole life (an MCP session) is opened on the bridge
loop and reached from any loop with `on_bridge`; a background worker that lives as long as
its owner is a task there (`spawn`).

Joining forked work never deadlocks on a busy pool: work no thread has started yet is taken
back and run by the thread that joins it, so a pool thread that forks and joins (a search
inside `run_blocking`) always makes progress.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
import os
import queue
import socket
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any, Generic, ParamSpec, TypeVar, cast

from keel.errors import UsageError

__all__ = [
    "Forked",
    "fork",
    "iterate_sync",
    "map_blocking",
    "on_bridge",
    "on_bridge_thread",
    "run_blocking",
    "run_in_thread",
    "run_sync",
    "spawn",
]

T = TypeVar("T")
A = TypeVar("A")
P = ParamSpec("P")

_logger = logging.getLogger("keel")

BLOCKING_THREADS = min(32, (os.cpu_count() or 1) + 4)
"""Threads of the blocking pool: asyncio's default for ``to_thread``, which it replaces, and
at least one per CPU, so an embedder's forward passes can use every core at once."""

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_thread: threading.Thread | None = None
_pool: ThreadPoolExecutor | None = None


def _bridge_loop() -> asyncio.AbstractEventLoop:
    global _loop, _thread
    with _lock:
        if _loop is None or _thread is None or not _thread.is_alive():
            loop = asyncio.new_event_loop()
            ready = threading.Event()

            def serve() -> None:
                asyncio.set_event_loop(loop)
                loop.call_soon(ready.set)
                loop.run_forever()

            thread = threading.Thread(target=serve, name="keel-sync-bridge", daemon=True)
            thread.start()
            ready.wait()
            _loop, _thread = loop, thread
        return _loop


def run_sync(
    coroutine: Coroutine[Any, Any, T],
    *,
    cleanup_wait_s: float = 30.0,
    in_running_loop: bool = False,
) -> T:
    """Run ``coroutine`` on keel's bridge loop and wait for its result.

    A caller that gives up (Ctrl-C raises KeyboardInterrupt while it waits) cancels the
    coroutine and waits up to ``cleanup_wait_s`` for its ``finally`` blocks to run on the bridge
    loop: when the interruption reaches the caller, what the coroutine held is released and
    what it committed is what the store holds.

    ``in_running_loop=True`` lets a thread whose own loop runs wait too (that loop stalls
    meanwhile): for the set-up and tear-down calls users make in ``with`` blocks anywhere
    (``with MCPServer.stdio(...) as server:``), never for a turn's work.

    Raises:
        UsageError: called from a thread whose event loop is running (await the async
            method there instead: blocking that loop would stall everything on it), or, with
            ``in_running_loop``, from the bridge loop itself (it would wait on itself).
    """
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        if not in_running_loop or running is _loop:
            coroutine.close()
            raise UsageError(
                "a sync method was called inside a running event loop: await its async twin"
            )
    finished = threading.Event()

    async def guarded() -> T:
        try:
            return await coroutine
        finally:
            finished.set()

    future = asyncio.run_coroutine_threadsafe(guarded(), _bridge_loop())
    try:
        return _await_in_thread(future.result)
    except BaseException:
        if not future.done():
            future.cancel()
            finished.wait(cleanup_wait_s)
        raise


async def on_bridge(coroutine: Coroutine[Any, Any, T]) -> T:
    """Await ``coroutine`` on keel's bridge loop, from any loop (cancelling the caller cancels
    it there).

    For what a library ties to the loop it was opened on for its whole life (an MCP session's
    anyio task group): opened on the bridge loop once, it serves callers on every loop.
    """
    loop = _bridge_loop()
    if asyncio.get_running_loop() is loop:
        return await coroutine
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coroutine, loop))


def spawn(coroutine: Coroutine[Any, Any, T]) -> Future[T]:
    """Start ``coroutine`` on keel's bridge loop and return at once: for a background worker
    that lives as long as its owner (memory's outbox), instead of a thread of its own. Its
    blocking steps go through `run_blocking`."""
    return asyncio.run_coroutine_threadsafe(coroutine, _bridge_loop())


def on_bridge_thread() -> bool:
    """Whether this thread runs keel's bridge loop (where waiting for it would wait forever)."""
    return _thread is not None and threading.current_thread() is _thread


SIGNAL_CHECK_S = 0.1
"""How often the main thread, waiting on the bridge, wakes to run Python's signal handlers: a
Ctrl-C that the kernel hands to another thread (the bridge's, a pool's) only reaches the main
thread when it runs Python code, and a wait without a timeout never does."""


def _await_in_thread(get: Callable[..., T]) -> T:
    """``get(timeout=...)`` until it returns; the main thread wakes every ``SIGNAL_CHECK_S`` so
    that KeyboardInterrupt is raised in it while it waits."""
    if threading.current_thread() is not threading.main_thread():
        return get()
    while True:
        try:
            return get(timeout=SIGNAL_CHECK_S)
        except (TimeoutError, queue.Empty):
            continue


_END = object()


def iterate_sync(iterable: AsyncIterator[T], *, cleanup_wait_s: float = 30.0) -> Iterator[T]:
    """Iterate ``iterable`` on keel's bridge loop, handing its items to this thread.

    Leaving the loop early (``break``, an exception, the iterator closed) cancels the async
    iteration where it waits, so its ``finally`` blocks run on the bridge loop, and waits up to
    ``cleanup_wait_s`` for them: when this returns, what the iteration held is released.

    Raises:
        UsageError: called inside a running event loop (iterate the async twin there).
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise UsageError("a sync iterator was used inside a running event loop: use its async twin")
    handoff: queue.SimpleQueue[Any] = queue.SimpleQueue()
    finished = threading.Event()

    async def pump() -> None:
        try:
            async for item in iterable:
                handoff.put((True, item))
            handoff.put(_END)
        except BaseException as exc:  # raised in the caller's thread
            handoff.put((False, exc))
            if not isinstance(exc, Exception):
                raise
        finally:
            finished.set()

    future = asyncio.run_coroutine_threadsafe(pump(), _bridge_loop())
    try:
        while True:
            item = _await_in_thread(handoff.get)
            if item is _END:
                return
            ok, value = item
            if not ok:
                raise value
            yield value
    finally:
        if not future.done():
            future.cancel()
        finished.wait(cleanup_wait_s)


def _blocking_pool() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(BLOCKING_THREADS, thread_name_prefix="keel-blocking")
        return _pool


async def run_blocking(function: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
    """Run the blocking ``function`` on keel's blocking pool and await its result.

    Every async path in keel that has to call blocking code (a SQLite store, an embedder, a
    file) goes through here; ``function`` sees the caller's context variables, as with
    ``asyncio.to_thread``.
    """
    call = partial(contextvars.copy_context().run, function, *args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(_blocking_pool(), call)


class Forked(Generic[T]):
    """Blocking work started on keel's blocking pool, whose result its caller joins."""

    def __init__(self, call: Callable[[], T]) -> None:
        self._call = call
        self._future: Future[T] | None
        try:
            self._future = _blocking_pool().submit(call)
        except RuntimeError:  # the interpreter is shutting down: join runs it here
            self._future = None

    def join(self) -> T:
        """The work's result (its exception raised here); work no pool thread has started
        yet runs in this thread, so joining never waits on a busy pool."""
        if self._future is None or self._future.cancel():
            ran: Future[T] = Future()  # a second join answers the same, never runs it again
            try:
                ran.set_result(self._call())
            except BaseException as exc:
                ran.set_exception(exc)
            self._future = ran
        return self._future.result()


def fork(function: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Forked[T]:
    """Start the blocking ``function`` on keel's blocking pool; ``join()`` the result."""
    return Forked(partial(contextvars.copy_context().run, function, *args, **kwargs))


def map_blocking(function: Callable[[A], T], items: Sequence[A], *, width: int) -> list[T]:
    """``function`` over ``items``, at most ``width`` calls at once (this thread runs one
    lane, the pool the others; each lane takes the next item when it is free), results in
    the items' order. Every call has ended when this returns or raises."""
    results: list[Any] = [None] * len(items)
    counter = itertools.count()

    def lane() -> None:
        while (index := next(counter)) < len(items):
            results[index] = function(items[index])

    lanes = [fork(lane) for _ in range(min(width, len(items)) - 1)]
    try:
        lane()
    finally:
        errors = []
        for forked in lanes:
            try:
                forked.join()
            except BaseException as exc:
                errors.append(exc)
    if errors:
        raise errors[0]
    return results


class _Job:
    """One call on an own thread: its outcome, and how it reaches a caller who awaits it."""

    __slots__ = ("deliver", "lock", "outcome", "run")

    def __init__(self, run: Callable[[], _Outcome]) -> None:
        self.run = run
        self.lock = threading.Lock()
        self.outcome: _Outcome | None = None
        self.deliver: Callable[[_Outcome], None] | None = None

    def finish(self, outcome: _Outcome) -> None:
        """Keep the outcome for a caller who has not started waiting, or hand it to the one
        who has."""
        with self.lock:
            self.outcome = outcome
            deliver = self.deliver
        if deliver is not None:
            deliver(outcome)

    def collect(self, deliver: Callable[[_Outcome], None]) -> _Outcome | None:
        """The outcome if the call has ended; else None, and ``deliver`` gets it when it does."""
        with self.lock:
            if self.outcome is None:
                self.deliver = deliver
            return self.outcome


class _OwnThread:
    """A daemon thread woken by a byte on a socket pair: the waker sends it with the GIL
    released (a socket write releases it), so the woken thread can take the GIL and run a
    short call at once, often before the waker has it back (`run_in_thread` then has the
    outcome without a trip through its event loop). A queue's put keeps the GIL: the woken
    thread waited for the waker to reach its loop's wait, and the loop was woken back."""

    def __init__(self, pool: _OwnThreads) -> None:
        self._pool = pool
        self._job: _Job | None = None
        self._wake: socket.socket | None = None
        self._woken: socket.socket | None = None
        self._inbox: queue.SimpleQueue[bool] | None = None
        try:
            self._wake, self._woken = socket.socketpair()
        except OSError:
            # Out of descriptors (a thread a call in flight, two descriptors each): woken
            # through a queue instead, one wake-up slower, never a call refused.
            self._inbox = queue.SimpleQueue()
        threading.Thread(target=self._work, name="keel-thread", daemon=True).start()

    def give(self, job: _Job) -> None:
        self._job = job
        if self._wake is not None:
            self._wake.send(b"\0")
        else:
            assert self._inbox is not None
            self._inbox.put(True)

    def close(self) -> None:
        if self._wake is not None and self._woken is not None:
            self._wake.close()
            self._woken.close()

    def _woken_within_idle_time(self) -> bool:
        if self._woken is None:
            assert self._inbox is not None
            try:
                return self._inbox.get(timeout=self._pool.idle_s)
            except queue.Empty:
                return False
        try:
            self._woken.recv(1)
        except TimeoutError:
            return False
        return True

    def _work(self) -> None:
        # A timeout on the socket (poll underneath), not select(): select refuses a descriptor
        # numbered over 1024, which a busy server's socket pair can be.
        if self._woken is not None:
            self._woken.settimeout(self._pool.idle_s)
        while True:
            if not self._woken_within_idle_time():
                if self._pool.retire(self):
                    self.close()
                    return
                continue  # a caller took this thread just now: its job is on the way
            job = self._job
            assert job is not None
            self._job = None
            outcome = job.run()
            self._pool.rest(self)
            job.finish(outcome)


class _OwnThreads:
    """Daemon threads for work that may never end: an idle one is reused, a new one starts
    when none is.

    Daemon, so work that hangs never keeps the process from exiting; never a bounded pool, so
    work that hangs holds its own thread and nothing queues behind it (a bounded pool would
    fill up with hung calls, and the blocking pool's short work would wait behind them). Reuse
    spares each call a thread start (hundreds of microseconds on a busy machine). A thread
    idle for ``idle_s`` ends.
    """

    def __init__(self, idle_s: float = 30.0) -> None:
        self.idle_s = idle_s
        self._lock = threading.Lock()
        self._idle: list[_OwnThread] = []
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        # A forked child has none of its parent's threads, only copies of their sockets.
        for thread in self._idle:
            thread.close()
        self._lock = threading.Lock()
        self._idle = []

    def submit(self, job: _Job) -> None:
        """Run ``job`` in an idle thread, or a new one."""
        with self._lock:
            thread = self._idle.pop() if self._idle else None
        if thread is None:
            thread = _OwnThread(self)
        thread.give(job)

    def rest(self, thread: _OwnThread) -> None:
        """``thread`` is idle again (before it hands its outcome over, so that the caller's
        next call can reuse it)."""
        with self._lock:
            self._idle.append(thread)

    def retire(self, thread: _OwnThread) -> bool:
        """Whether ``thread``, idle for ``idle_s``, may end (no caller took it meanwhile)."""
        with self._lock:
            if thread in self._idle:
                self._idle.remove(thread)
                return True
            return False


_Outcome = tuple[bool, Any]
_own_threads = _OwnThreads()

Abandoned = Callable[[bool, Any], None]
"""Told ``(ok, value)`` when work run by `run_in_thread` ends after its caller stopped
waiting (a timeout, a cancellation)."""


async def run_in_thread(call: Callable[[], T], *, on_abandoned: Abandoned | None = None) -> T:
    """Run ``call`` in a daemon thread of its own and await its result (context variables
    carried over), for work that may run far longer than its caller waits: a user's sync tool
    that hangs past its timeout, a model's generation. Cancelling the caller stops waiting,
    not ``call``: its late outcome goes to ``on_abandoned``.

    A short ``call`` has often ended by the time the thread is woken and this one runs again
    (see `_OwnThread`): its outcome is then returned at once, without waiting on the loop.
    Work that takes longer (or blocks, releasing the GIL) is awaited, so a timeout or a
    cancellation stops the wait as before.

    `run_blocking` is for keel's own short blocking work: its pool is bounded, so work that
    may never return must not hold one of its threads.
    """
    loop = asyncio.get_running_loop()
    context = contextvars.copy_context()

    def run() -> _Outcome:
        try:
            return True, context.run(call)
        except BaseException as exc:
            return False, exc

    job = _Job(run)
    _own_threads.submit(job)
    future: asyncio.Future[T] = loop.create_future()

    def abandon(ok: bool, value: Any) -> None:
        if on_abandoned is None:
            return
        try:
            on_abandoned(ok, value)
        except Exception:  # a report about abandoned work must never crash anything
            _logger.exception("could not report the late result of abandoned work")

    def deliver(ok: bool, value: Any) -> None:
        if future.done():  # the caller stopped waiting (timeout, cancellation)
            abandon(ok, value)
            return
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)

    def hand_over(outcome: _Outcome) -> None:
        try:
            loop.call_soon_threadsafe(deliver, *outcome)
        except RuntimeError:  # the event loop is closed: nobody is waiting any more
            abandon(*outcome)

    outcome = job.collect(hand_over)
    if outcome is not None:
        ok, value = outcome
        if ok:
            return cast(T, value)
        raise value
    return await future
