"""The advisory lease on a session (``SessionLock``), and how a dead holder is recognised."""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from keel.errors import DatabaseLockedError
from keel.state._backend import StateBackend
from keel.state._twins import backend_call, pause, sync_twin

__all__ = ["THIS_PROCESS", "SessionLock"]


def _process_identity() -> str:
    """This machine, PID namespace and process: enough to tell, from another process on the
    same machine, whether a lease's holder still runs."""
    try:
        namespace = Path("/proc/self/ns/pid").stat().st_ino
    except OSError:
        namespace = 0
    return f"{socket.gethostname()}:{namespace}:{os.getpid()}"


THIS_PROCESS = _process_identity()
"""``host:pid-namespace:pid`` of this process, the prefix of every lease owner it makes."""


def _died(holder: str) -> bool:
    """Whether the owner ``holder`` is a process of this machine (and PID namespace) that no
    longer runs. Owners from elsewhere, or in any other format, are never presumed dead."""
    host, _, rest = holder.partition(":")
    namespace, _, rest = rest.partition(":")
    pid_text, _, _ = rest.partition(":")
    mine_host, mine_namespace, mine_pid = THIS_PROCESS.split(":")
    if host != mine_host or namespace != mine_namespace or not pid_text.isdigit():
        return False
    pid = int(pid_text)
    if pid == int(mine_pid):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


class SessionLock:
    """An advisory lease on a session (``with store.lock(session_id): ...``).

    Advisory only: it keeps well-behaved writers from racing, but correctness never depends on
    it. A writer whose lease expired mid-work is still rejected by the version check (fencing).

    Entered (``with`` or ``async with``), it is held for the block: taken waiting up to
    ``wait`` seconds (``DatabaseLockedError`` after that), released at the end if still held.
    """

    def __init__(
        self,
        backend: StateBackend,
        key: str,
        ttl: float,
        clock: Callable[[], float],
        *,
        wait: float = 0.0,
    ):
        self._backend = backend
        self.key = key
        self.ttl = ttl
        self.wait = wait
        # The owner names its machine and process, so that a process on the same machine can
        # tell that a holder died (SIGKILL, power cut of a laptop app) and take over at once.
        self.owner = f"{THIS_PROCESS}:{uuid.uuid4().hex}"
        self._clock = clock
        self.held = False

    async def aacquire(self, wait: float = 0.0) -> bool:
        """Try to take the lease, retrying for up to ``wait`` seconds."""
        backend = self._backend
        deadline = time.monotonic() + wait
        delay = 0.005
        while True:
            args = (self.key, self.owner, self.ttl, self._clock())
            if await backend_call(backend.acquire_lock, backend.aacquire_lock, *args):
                self.held = True
                return True
            holder = await backend_call(
                backend.lock_holder, backend.alock_holder, self.key, self._clock()
            )
            if holder is not None and _died(holder):
                await backend_call(backend.release_lock, backend.arelease_lock, self.key, holder)
                continue
            if time.monotonic() >= deadline:
                return False
            await pause(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 0.1)

    async def arelease(self) -> bool:
        """Release the lease if this owner still holds it (False if it expired and was taken)."""
        backend = self._backend
        released = await backend_call(
            backend.release_lock, backend.arelease_lock, self.key, self.owner
        )
        self.held = False
        return released

    async def __aenter__(self) -> SessionLock:
        if not await self.aacquire(self.wait):
            session_id = self.key.removeprefix("session:")
            raise DatabaseLockedError(
                f"session {session_id!r} is locked by another writer (waited {self.wait}s)"
            )
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self.held:
            await self.arelease()

    acquire = sync_twin(aacquire)
    release = sync_twin(arelease)
    __enter__ = sync_twin(__aenter__)
    __exit__ = sync_twin(__aexit__)
