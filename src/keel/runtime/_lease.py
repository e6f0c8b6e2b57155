"""Owning a session for one turn: the state store's lease, renewed in the background."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from keel.errors import SessionBusyError, StoreError, TurnInterruptedError
from keel.state import SessionLock, StateStore

__all__ = ["Lease", "own_session"]

logger = logging.getLogger("keel.runtime")


class Lease:
    """This turn's ownership of a session: the store's lease, renewed in the background.

    The lease keeps well-behaved writers apart across threads and processes; correctness does
    not rest on it: every write is compare-and-set, and before each side effect the lease is
    renewed so a worker that stalled past it never acts on a session another one took over.
    """

    def __init__(self, lock: SessionLock, session_id: str) -> None:
        self.lock = lock
        self.session_id = session_id
        self.lost = False
        self._ended = asyncio.Event()

    async def heartbeat(self) -> None:
        """Renew the lease every third of its time to live until `end`."""
        period = max(self.lock.ttl / 3, 0.05)
        while not self.lost:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._ended.wait(), period)
            # Checked after every await, not left to cancellation alone: a client library
            # can swallow a cancel that lands mid-command (asyncio.wait_for before Python
            # 3.12 drops one that races the inner result), and this loop would renew the
            # lease forever while the turn waits for it to stop.
            if self._ended.is_set():
                return
            try:
                if not await self.lock.aacquire(0):
                    self.lost = True
            except StoreError:
                logger.warning("could not renew the lease on session %s", self.session_id)

    async def end(self, heartbeat: asyncio.Task[None]) -> None:
        """Stop renewing: the turn is over."""
        self._ended.set()
        heartbeat.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await heartbeat

    async def check(self) -> None:
        """Renew now; raise when another owner has taken the session."""
        if not self.lost:
            try:
                self.lost = not await self.lock.aacquire(0)
            except StoreError as exc:
                raise TurnInterruptedError(
                    self.session_id, "its lease could not be renewed"
                ) from exc
        if self.lost:
            raise TurnInterruptedError(self.session_id, "another worker took its lease")


@contextlib.asynccontextmanager
async def own_session(
    store: StateStore[Any], key: str, *, ttl: float, wait_s: float
) -> AsyncIterator[Lease]:
    """Hold session ``key`` for the block: wait up to ``wait_s`` for its lease (else
    [`SessionBusyError`][]), renew it while the block runs, release it after."""
    lock = store.session_lock(key, ttl=ttl)
    if not await lock.aacquire(wait_s):
        raise SessionBusyError(key, wait_s)
    lease = Lease(lock, key)
    heartbeat = asyncio.create_task(lease.heartbeat())
    try:
        yield lease
    finally:
        await lease.end(heartbeat)
        if not lease.lost:
            try:
                await lock.arelease()
            except StoreError:
                # It expires by itself; the next turn waits at most its time to live.
                logger.warning("could not release the lease on session %s", key)
