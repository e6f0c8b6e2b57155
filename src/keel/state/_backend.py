"""The storage interface every state backend implements (SQLite, PostgreSQL, Redis).

Backends store checkpoints as JSON payloads and enforce compare-and-set on a session's version;
they know nothing about state types, reducers or delta encoding (``StateStore`` does that), so a
new backend is a few hundred lines of driver code and must pass ``keel.testing.state_conformance``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

from keel._bridge import run_blocking

__all__ = ["Chain", "SessionHead", "StateBackend", "StoredCheckpoint"]

_T = TypeVar("_T")


@dataclass(frozen=True)
class StoredCheckpoint:
    """One checkpoint row as a backend stores it."""

    version: int
    created_at: float
    step: int
    reason: str
    kind: Literal["full", "delta"]
    payload: str
    schema_name: str
    schema_version: int
    good: bool | None = None
    forked_from: str | None = None
    payload_size: int | None = None
    """Bytes of the payload when it was left out (history listings)."""

    @property
    def size(self) -> int:
        """Bytes of the payload."""
        if self.payload_size is not None:
            return self.payload_size
        if self.payload.isascii():
            return len(self.payload)
        return len(self.payload.encode())


@dataclass(frozen=True)
class SessionHead:
    """The current position of a session: its version and what guards it."""

    session_id: str
    version: int
    epoch: str
    """Random token set when the session is created; a delete-and-recreate changes it, so a
    writer holding the old incarnation's version can never write a delta onto the new one."""
    last_full: int
    ttl: float | None
    expires_at: float | None


@dataclass(frozen=True)
class Chain:
    """What it takes to rebuild one version: the nearest full snapshot and the deltas after it."""

    head: SessionHead
    rows: list[StoredCheckpoint]


class StateBackend(ABC):
    """Raw checkpoint storage with compare-and-set. Every method is atomic on its own.

    The sync/async contract:

    - Every operation is a sync method, which blocks its thread until done. Sync code calls
      them: ``StateStore``'s sync twins (``get``, ``append``, ...) call them inline in the
      caller's thread (``state/_twins.py``), and so may code in a worker thread.
    - The operations of a turn (``read_chain``, ``read_head_chain``, ``write``, ``history``,
      ``mark``, ``delete``, the leases, ``close``) also have an ``a``-prefixed async twin: the
      same operation, for code on a running event loop (``StateStore``'s async methods,
      ``SessionLock``), which it never holds up waiting: for a lock, a server or a pool.
    - Maintenance (``rewrite``, ``sessions``, ``purge_expired``, ``storage_bytes``) is sync
      only: an async caller runs it on keel's blocking pool (``StateStore.avacuum`` does,
      through ``keel._bridge.run_blocking``).

    Each backend writes an operation once: the SQL one as a plan its database runs with
    ``run`` or ``arun`` (SQLite inline on the loop unless it would wait, PostgreSQL on the
    loop's own connections); the Redis one as the async method, whose sync twin drives the same
    coroutine on its sync client (``state/_twins.py``). A backend that implements only the sync
    methods gets async twins that run them on keel's blocking pool.

    Implementations translate driver errors into ``keel.errors`` (``BackendUnavailableError``,
    ``StoreError``) and raise ``ConflictError`` when a version check fails, with nothing of the
    failed write visible.
    """

    name: str = "backend"
    """Short name of the backend ("sqlite", "postgres", "redis")."""

    @abstractmethod
    def read_chain(self, session_id: str, version: int | None, now: float) -> Chain | None:
        """The snapshot and deltas up to ``version`` (the head if None), from one consistent read.

        Returns None when the session does not exist (or the version is not stored).

        Raises:
            ExpiredError: the session's time to live has passed (until it is vacuumed away).
        """

    @abstractmethod
    def write(
        self,
        session_id: str,
        row: StoredCheckpoint,
        *,
        expected_version: int | None,
        expected_epoch: str | None,
        new_epoch: str | None,
        ttl: float | None,
        now: float,
    ) -> None:
        """Append ``row`` (version = expected + 1) if the head is still ``expected_version``.

        With ``expected_version=None`` the session is created (``row.version == 1``,
        ``new_epoch`` and ``ttl`` set): allowed only when no live session exists; an expired one
        is replaced with its history. Every write slides the expiry to ``now + ttl``.

        Raises:
            ConflictError: the head moved on (or the session exists, for a create, or its epoch
                differs); nothing was written.
        """

    @abstractmethod
    def history(self, session_id: str, now: float) -> list[StoredCheckpoint]:
        """Every stored checkpoint of the session, oldest first, payloads left out (sizes kept).

        Raises:
            ExpiredError: the session has expired.
        """

    @abstractmethod
    def mark(self, session_id: str, version: int, good: bool | None) -> bool:
        """Mark a checkpoint good or bad (None clears); False when it is not stored."""

    @abstractmethod
    def rewrite(self, session_id: str, delete: list[int], replace: list[StoredCheckpoint]) -> None:
        """Delete old versions and replace others (rebased as full snapshots), atomically.

        The head version is never deleted; used by retention.
        """

    @abstractmethod
    def delete(self, session_id: str) -> bool:
        """Delete a session and its whole history; False when there was none."""

    @abstractmethod
    def sessions(self) -> list[str]:
        """The ids of stored sessions (expired ones included until vacuumed)."""

    @abstractmethod
    def purge_expired(self, now: float) -> list[str]:
        """Delete every session whose expiry has passed; their ids."""

    @abstractmethod
    def acquire_lock(self, key: str, owner: str, ttl: float, now: float) -> bool:
        """Take the advisory lease ``key`` for ``owner`` for ``ttl`` seconds, if free or expired."""

    @abstractmethod
    def release_lock(self, key: str, owner: str) -> bool:
        """Release the lease if ``owner`` still holds it."""

    def lock_holder(self, key: str, now: float) -> str | None:
        """The owner holding the lease ``key`` now, or None (free, expired, or not known: the
        default, for backends that cannot tell). Lets a new process take over the lease of a
        process on the same machine that died holding it instead of waiting for its expiry."""
        return None

    def sessions_under(self, prefix: str) -> list[str]:
        """The ids of stored sessions that start with ``prefix`` (a tenant's: a user's
        erasure, `keel.state.erase_user_sessions`). This default filters [`sessions`][]; a
        backend that can should ask its store for those alone."""
        return [session_id for session_id in self.sessions() if session_id.startswith(prefix)]

    def erase_sessions(self, session_ids: Sequence[str]) -> dict[str, int]:
        """Delete the sessions ``session_ids`` whole (every checkpoint, the head, the lease
        ``session:<id>``): a user's erasure. Idempotent (a session already gone counts 0).
        Returns what was removed: ``{"sessions": ..., "checkpoints": ..., "leases": ...}``.

        This default counts each session's history and deletes it; a backend should do it
        in one transaction and remove the leases too."""
        sessions = checkpoints = 0
        for session_id in session_ids:
            # Read as of 1970, before any expiry: an expired session's rows are counted too.
            found = len(self.history(session_id, 0.0))
            if self.delete(session_id):
                sessions += 1
                checkpoints += found
        return {"sessions": sessions, "checkpoints": checkpoints, "leases": 0}

    @abstractmethod
    def storage_bytes(self) -> int:
        """Bytes the backend uses for state (tables and indexes, or Redis memory)."""

    @abstractmethod
    def close(self) -> None:
        """Release connections."""

    # --- async twins: keel's blocking pool by default; keel's backends implement them --------

    async def _run_twin(self, call: Callable[[], _T]) -> _T:
        """Run one sync method's body for an async twin: on keel's blocking pool, so a
        database round trip never blocks the event loop."""
        return await run_blocking(call)

    async def aread_chain(self, session_id: str, version: int | None, now: float) -> Chain | None:
        """Async twin of ``read_chain``."""
        return await self._run_twin(lambda: self.read_chain(session_id, version, now))

    def read_head_chain(
        self, session_id: str, now: float, known_version: int, known_epoch: str
    ) -> Chain | None:
        """The chain of the head, like ``read_chain(session_id, None, now)``, for a caller that
        already holds version ``known_version`` of incarnation ``known_epoch``, which it may
        start later: while that version is still the head, at the head row alone (its state is
        known; its metadata, such as the good mark, is read fresh); once another writer moved
        the head on within that incarnation, at the row after it (the caller applies the rows
        written since to the state it holds), or at a full snapshot among them. The whole
        chain is always a right answer (the default), and the one for another incarnation.
        """
        return self.read_chain(session_id, None, now)

    async def aread_head_chain(
        self, session_id: str, now: float, known_version: int, known_epoch: str
    ) -> Chain | None:
        """Async twin of ``read_head_chain``."""
        return await self._run_twin(
            lambda: self.read_head_chain(session_id, now, known_version, known_epoch)
        )

    async def awrite(
        self,
        session_id: str,
        row: StoredCheckpoint,
        *,
        expected_version: int | None,
        expected_epoch: str | None,
        new_epoch: str | None,
        ttl: float | None,
        now: float,
    ) -> None:
        """Async twin of ``write``."""
        await self._run_twin(
            lambda: self.write(
                session_id,
                row,
                expected_version=expected_version,
                expected_epoch=expected_epoch,
                new_epoch=new_epoch,
                ttl=ttl,
                now=now,
            )
        )

    async def ahistory(self, session_id: str, now: float) -> list[StoredCheckpoint]:
        """Async twin of ``history``."""
        return await self._run_twin(lambda: self.history(session_id, now))

    async def amark(self, session_id: str, version: int, good: bool | None) -> bool:
        """Async twin of ``mark``."""
        return await self._run_twin(lambda: self.mark(session_id, version, good))

    async def adelete(self, session_id: str) -> bool:
        """Async twin of ``delete``."""
        return await self._run_twin(lambda: self.delete(session_id))

    async def aacquire_lock(self, key: str, owner: str, ttl: float, now: float) -> bool:
        """Async twin of ``acquire_lock``."""
        return await self._run_twin(lambda: self.acquire_lock(key, owner, ttl, now))

    async def arelease_lock(self, key: str, owner: str) -> bool:
        """Async twin of ``release_lock``."""
        return await self._run_twin(lambda: self.release_lock(key, owner))

    async def alock_holder(self, key: str, now: float) -> str | None:
        """Async twin of ``lock_holder``."""
        return await self._run_twin(lambda: self.lock_holder(key, now))

    async def aclose(self) -> None:
        """Async twin of ``close``."""
        await self._run_twin(self.close)
