"""Sync twins served from one async core, run inline in the caller's thread.

This is keel's one way to write an operation once as a coroutine and give it a sync twin that
runs in the caller's thread (``docs/architecture.md``, "One async policy"); SQL beneath it
needs none, as a store's statements are a plan the database object runs with ``run`` or
``arun`` (``stores/_sql_plan.py``).

``StateStore``, ``SessionLock`` and the Redis state backend write each operation once, as a
coroutine that reaches the backend (or the Redis client) only through `backend_call` (and waits
only through `pause`). The async method awaits that coroutine: backend calls go to the
backend's async twins (the database's ``arun`` on SQL: SQLite inline unless it would wait,
PostgreSQL on the loop's own connections; native on Redis). Its sync twin, made by
`sync_twin`, drives the same coroutine to its end with no event loop: while it runs, every
backend call goes to the backend's blocking sync method, so the coroutine never suspends.

Why not ``keel._bridge.run_sync``: a sync call would hop to the bridge's loop thread and from
there to a worker thread for SQLite, about 170 us a call on this machine, five times a SQLite
head read (35 us); and it would refuse to run inside a running event loop, where the sync API
has always worked (blocking that loop, as any sync call does).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine
from contextvars import ContextVar
from typing import Any, Concatenate, ParamSpec, TypeVar

__all__ = ["backend_call", "pause", "sync_twin"]

P = ParamSpec("P")
T = TypeVar("T")
Owner = TypeVar("Owner")

_INLINE: ContextVar[bool] = ContextVar("keel_state_inline", default=False)
"""True while a sync twin drives its coroutine: backend calls then block instead of awaiting."""


def sync_twin(
    method: Callable[Concatenate[Owner, P], Coroutine[Any, Any, T]],
) -> Callable[Concatenate[Any, P], T]:
    """The sync twin of the async ``method``: the same coroutine, run inline over the
    backend's sync methods. Assign it in the class body (``get = sync_twin(aget)``); its
    ``self`` is typed ``Any`` so that it may implement an interface's sync method."""

    def twin(self: Owner, /, *args: P.args, **kwargs: P.kwargs) -> T:
        token = _INLINE.set(True)
        try:
            return _run_inline(method(self, *args, **kwargs))
        finally:
            _INLINE.reset(token)

    name = method.__name__
    name = name.replace("__a", "__", 1) if name.startswith("__a") else name.removeprefix("a")
    twin.__name__ = name
    twin.__qualname__ = method.__qualname__.rpartition(".")[0] + "." + name
    twin.__doc__ = f"Sync twin of ``{method.__name__}`` (the same code, blocking)."
    return twin


def _run_inline(coroutine: Coroutine[Any, Any, T]) -> T:
    try:
        coroutine.send(None)
    except StopIteration as done:
        result: T = done.value
        return result
    # Only a bug gets here: the core awaited something other than backend_call or pause.
    coroutine.close()
    raise RuntimeError(f"{coroutine!r} waited on an event loop in its sync twin")


async def backend_call(
    blocking: Callable[P, T],
    awaitable: Callable[P, Awaitable[T]],
    /,
    *args: P.args,
    **kwargs: P.kwargs,
) -> T:
    """``blocking(*args)`` inside a sync twin, else ``await awaitable(*args)``: the one way the
    async core reaches a backend (``await backend_call(b.read_chain, b.aread_chain, ...)``)."""
    if _INLINE.get():
        return blocking(*args, **kwargs)
    return await awaitable(*args, **kwargs)


async def pause(seconds: float) -> None:
    """Wait ``seconds``: ``time.sleep`` inside a sync twin, ``asyncio.sleep`` otherwise."""
    if _INLINE.get():
        time.sleep(seconds)
    else:
        await asyncio.sleep(seconds)
