"""The one bridge from sync code to keel's async core.

Every sync twin (``Agent.handle_sync``, ``ChatModel.complete``, ``Memory.retrieve``, ...) runs
its coroutine on ONE long-lived event loop in a daemon thread, the blocking-portal pattern,
instead of a new event loop per call. What an async client keeps per loop (an HTTP
connection pool, a PostgreSQL or Redis async pool) is then made once and reused, not leaked
with each call's dead loop, and sync calls from several threads share one loop safely.

The other direction, async code calling a blocking function (SQLite, an ONNX embedder), goes
through :func:`run_blocking`, the one place that decides where blocking work runs.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any, ParamSpec, TypeVar

from keel.errors import UsageError

__all__ = ["iterate_sync", "run_blocking", "run_sync"]

T = TypeVar("T")
P = ParamSpec("P")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_thread: threading.Thread | None = None


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


def run_sync(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run ``coroutine`` on keel's bridge loop and wait for its result.

    Raises:
        UsageError: called from a thread whose event loop is running (await the async
            method there instead: blocking that loop would stall everything on it).
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        coroutine.close()
        raise UsageError(
            "a sync method was called inside a running event loop: await its async twin"
        )
    future = asyncio.run_coroutine_threadsafe(coroutine, _bridge_loop())
    try:
        return future.result()
    except BaseException:
        # The caller gave up (KeyboardInterrupt, say): stop the work it no longer waits for.
        future.cancel()
        raise


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
            item = handoff.get()
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


async def run_blocking(function: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
    """Run the blocking ``function`` off the event loop and await its result.

    Every async path in keel that has to call blocking code (a SQLite store, an embedder, a
    file) goes through here, so where such work runs (today: the running loop's default
    executor, with the caller's context variables) is decided in one place.
    """
    return await asyncio.to_thread(function, *args, **kwargs)
