"""``StateStore``: typed, versioned, compare-and-set state with history, on any backend.

Every write names the version it read; the backend appends the next version only if the head is
still that version, else ``ConflictError`` and nothing of the write is visible. Checkpoints are
stored as deltas (appended list tails, changed fields) with a full snapshot once the deltas since
the last one outweigh it (and at least ``snapshot_every`` versions after it), so storage grows
with what changed (``VersionCodec``); the newest version of each session read or written is kept
to encode the next delta cheaply (``KnownVersions``).

Each operation is written once, as the async method; its sync twin runs the same code inline
over the backend's sync methods (``keel.state._twins``). The async twins reach the backend's
async methods (``StateBackend`` states the contract).

A read of a session whose head another writer (another process) moved on, where this store
holds an earlier version, reads the rows written since and applies them to that version
(``KnownVersions``): a decision by a worker that did not write the head costs the turns it
missed, not the session's length.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any, Generic, TypeVar, cast

from keel._bridge import run_blocking
from keel.errors import ConflictError, StateError, UsageError
from keel.state._backend import StateBackend, StoredCheckpoint
from keel.state._checkpoint import (
    Checkpoint,
    CheckpointInfo,
    CheckpointReason,
    Retention,
    VacuumReport,
)
from keel.state._codec import Base, VersionCodec, checkpoint_info, ttl_seconds
from keel.state._known import KNOWN_BYTES, KNOWN_SESSIONS, KnownVersions, Partial, whole
from keel.state._lease import SessionLock
from keel.state._retention import drop_rows, vacuum
from keel.state._schema import StateSchema
from keel.state._twins import backend_call, pause, sync_twin

__all__ = ["StateStore"]

S = TypeVar("S")

_LARGEST_VERSION = 2**31 - 1
"""The largest version a backend stores (PostgreSQL's ``INTEGER`` column): a larger one is not
stored anywhere, and asking a database for it fails there (SQLite past 2**63, PostgreSQL past
2**31) instead of saying so."""


class StateStore(Generic[S]):
    """Typed, versioned state of agent sessions on one backend.

    Every ``a``-prefixed method has a sync twin without the prefix (``get``/``aget``, ...):
    the same code, blocking.

    Args:
        backend: where checkpoints live (``Backends.open(url, settings=..., only=("state",))``
            opens one alone: ``.state.backend``).
        schema: the state type, or a ``StateSchema`` with its version and migrations.
        retention: how much history ``vacuum()`` keeps per session.
        snapshot_every: the fewest versions between two full snapshots (the rest are deltas).
            A snapshot is stored once this many versions have passed and the deltas since the
            last one outweigh it: a small state gets one every ``snapshot_every`` versions, a
            growing one ever more rarely, so storage stays linear in what changed while a read
            replays about one snapshot's worth of deltas. (A snapshot every so many versions
            would store a growing history over and over: quadratic in the session's length.)
        default_ttl: time to live (seconds or timedelta) of new sessions; each write extends it.
        clock: seconds since the epoch; injectable for tests of expiry and retention.
        known_sessions: how many sessions' newest state the store keeps in memory, the most
            recently used, so that their next read and write cost what is new (a session it no
            longer keeps is read whole); ``known_bytes``: about how much of their JSON, all
            together. A service worker meets sessions without end: these bound its memory.
    """

    def __init__(
        self,
        backend: StateBackend,
        schema: StateSchema[S] | type[S],
        *,
        retention: Retention | None = None,
        snapshot_every: int = 100,
        default_ttl: float | timedelta | None = None,
        clock: Callable[[], float] = time.time,
        known_sessions: int = KNOWN_SESSIONS,
        known_bytes: int = KNOWN_BYTES,
    ) -> None:
        if snapshot_every < 1:
            raise UsageError("snapshot_every must be >= 1")
        if known_sessions < 1 or known_bytes < 0:
            raise UsageError("known_sessions must be >= 1 and known_bytes >= 0")
        self.backend = backend
        self.schema: StateSchema[S] = (
            schema if isinstance(schema, StateSchema) else StateSchema(schema)
        )
        self.retention = retention or Retention()
        self.snapshot_every = snapshot_every
        self.default_ttl = ttl_seconds(default_ttl)
        self.clock = clock
        self._codec = VersionCodec(self.schema, snapshot_every, clock)
        self._known = KnownVersions(self._codec, max_sessions=known_sessions, max_bytes=known_bytes)

    # --- the backend, through the one core ----------------------------------------------------

    async def _read(
        self, session_id: str, version: int | None, *, copy: bool = True
    ) -> tuple[Base, Checkpoint[S]] | None:
        backend = self.backend
        cached = self._known.get(session_id) if version is None else None
        if cached is not None:
            chain = await backend_call(
                backend.read_head_chain,
                backend.aread_head_chain,
                session_id,
                self.clock(),
                cached.version,
                cached.epoch,
            )
            found = self._known.resolve(session_id, version, chain, cached, copy=copy)
            if not isinstance(found, Partial):
                return found
        chain = await backend_call(
            backend.read_chain, backend.aread_chain, session_id, version, self.clock()
        )
        return whole(self._known.resolve(session_id, version, chain, copy=copy))

    async def _base_for(self, session_id: str, expected_version: int) -> Base:
        """The base a write on ``expected_version`` encodes against (``ConflictError`` when the
        head is another version)."""
        cached = self._known.get(session_id)
        if cached is not None and cached.version == expected_version:
            return cached
        found = await self._read(session_id, None)
        if found is None:
            raise ConflictError(session_id, expected_version, None)
        base = found[0]
        if base.version != expected_version:
            raise ConflictError(session_id, expected_version, base.version)
        return base

    async def _put(
        self, base: Base, row: StoredCheckpoint, *, created: bool = False, ttl: float | None = None
    ) -> None:
        """Store ``row``: the version after ``base`` (compare-and-set on its version and
        epoch), or with ``created`` the session's version 1 that ``base`` is."""
        backend = self.backend
        await backend_call(
            backend.write,
            backend.awrite,
            base.session_id,
            row,
            expected_version=None if created else base.version,
            expected_epoch=None if created else base.epoch,
            new_epoch=base.epoch if created else None,
            ttl=ttl,
            now=row.created_at,
        )

    async def _commit(
        self,
        base: Base,
        state: S,
        *,
        reason: str,
        step: int | None,
        good: bool | None = None,
        kept: Mapping[str, int] | None = None,
    ) -> Checkpoint[S]:
        """Commit ``state`` on top of ``base``. ``kept``: the lists ``validate_extending`` built
        (the state is then the store's own, handed to no caller)."""
        row, new_base = self._codec.plan_write(
            base, state, reason=reason, step=step, good=good, kept=kept
        )
        await self._put(base, row)
        self._known.remember(new_base, frozenset(kept or ()))
        return Checkpoint(checkpoint_info(base.session_id, row), state)

    # --- reading ------------------------------------------------------------------------------

    async def aget(self, session_id: str) -> Checkpoint[S] | None:
        """The latest checkpoint of a session, or None if there is none.

        Raises:
            ExpiredError: the session existed but its time to live has passed (it reads as
                absent: the state is not returned).
            StateMigrationError: stored data from another schema version with no migration.
        """
        found = await self._read(session_id, None)
        return None if found is None else found[1]

    async def apeek(self, session_id: str) -> Checkpoint[S] | None:
        """``aget`` for a reader that only reads: the latest checkpoint, its state not copied.

        A read of the version this store last wrote then costs one head row however long the
        state's lists are. The state may be this store's own: read it at once, and never change
        or keep it (a later ``append`` grows its lists in place).
        """
        found = await self._read(session_id, None, copy=False)
        return None if found is None else found[1]

    async def aload(self, session_id: str) -> Checkpoint[S]:
        """Like ``aget`` but a missing session raises ``StateError``."""
        found = await self.aget(session_id)
        if found is None:
            raise StateError(f"no state stored for session {session_id!r}")
        return found

    async def aat(self, session_id: str, version: int) -> Checkpoint[S]:
        """The checkpoint at ``version``.

        Raises:
            StateError: that version is not stored (never written, or removed by retention).
        """
        found = await self._read(session_id, version) if _storable(version) else None
        if found is None or found[1].version != version:
            raise StateError(f"session {session_id!r} has no stored version {version}")
        return found[1]

    async def ahistory(self, session_id: str, limit: int | None = None) -> list[CheckpointInfo]:
        """The session's checkpoints, newest first (at most ``limit``)."""
        backend = self.backend
        rows = await backend_call(backend.history, backend.ahistory, session_id, self.clock())
        infos = [checkpoint_info(session_id, row) for row in reversed(rows)]
        return infos[:limit] if limit is not None else infos

    async def alast_good(self, session_id: str) -> CheckpointInfo | None:
        """The newest checkpoint marked good, if any."""
        for info in await self.ahistory(session_id):
            if info.good:
                return info
        return None

    def sessions(self) -> list[str]:
        """Ids of stored sessions."""
        return self.backend.sessions()

    # --- writing ------------------------------------------------------------------------------

    async def acreate(
        self,
        session_id: str,
        state: S | Mapping[str, Any],
        *,
        ttl: float | timedelta | None = None,
        reason: str = CheckpointReason.CREATED,
        step: int = 0,
        forked_from: str | None = None,
        good: bool | None = None,
    ) -> Checkpoint[S]:
        """Create a session at version 1 with ``state`` (validated); ``good`` marks that first
        checkpoint as ``mark`` would, in the same write.

        An expired session with the same id is replaced.

        Raises:
            ConflictError: a live session with this id exists (expected None, actual its
                version).
            StateValidationError: the state fails the schema.
        """
        row, base = self._codec.plan_create(session_id, state, reason, step, forked_from, good)
        ttl_s = ttl_seconds(ttl) if ttl is not None else self.default_ttl
        await self._put(base, row, created=True, ttl=ttl_s)
        self._known.remember(base)
        return Checkpoint(checkpoint_info(session_id, row), cast(S, base.state))

    async def acheckpoint(
        self,
        session_id: str,
        state: S | Mapping[str, Any],
        *,
        expected_version: int,
        reason: str,
        step: int | None = None,
        good: bool | None = None,
    ) -> int:
        """Commit ``state`` as the next version if the head is still ``expected_version``.

        Call it before every model call and after every transition. Returns the new version.

        Raises:
            ConflictError: another writer committed first; nothing was written. Re-read and
                decide again.
            StateValidationError: the state fails the schema.
        """
        cached = self._known.get(session_id)
        if cached is not None and cached.version == expected_version:
            typed, kept = self._codec.validate_on(cached, state)
            base = cached
        else:
            typed, kept = self.schema.validate(state), {}
            base = await self._base_for(session_id, expected_version)
        written = await self._commit(base, typed, reason=reason, step=step, good=good, kept=kept)
        return written.version

    async def aappend(
        self,
        session_id: str,
        append: Mapping[str, Sequence[Any]],
        *,
        expected_version: int,
        reason: str,
        update: Mapping[str, Any] | None = None,
        step: int | None = None,
        good: bool | None = None,
    ) -> int:
        """Commit, as the next version if the head is still ``expected_version``, that
        version with ``append``'s items added to the end of those list fields and ``update``'s
        fields set (replaced, not reduced).

        What ``checkpoint`` of the whole new state does, at a cost that grows with the items
        and fields given, not with the length of the lists they extend: the turn loop of a
        100,000-message session appends a message as cheaply as on its first turn. Returns the
        new version.

        Raises:
            ConflictError: another writer committed first; nothing was written.
            StateValidationError: the new state fails the schema.
            UsageError: an unknown field, or ``append`` names a field that is not a list.
        """
        base = await self._base_for(session_id, expected_version)
        plan = self._codec.plan_append(
            base, append, update or {}, reason=reason, step=step, good=good
        )
        if plan is None:
            typed, kept = self._codec.appended_state(base, append, update or {})
            written = await self._commit(
                base, typed, reason=reason, step=step, good=good, kept=kept
            )
            return written.version
        await self._put(base, plan.row)
        return self._known.remember_append(plan)

    async def aupdate(
        self,
        session_id: str,
        update: Mapping[str, Any],
        *,
        expected_version: int,
        reason: str = CheckpointReason.UPDATE,
        step: int | None = None,
        good: bool | None = None,
    ) -> Checkpoint[S]:
        """Apply ``update`` through the fields' reducers to version ``expected_version`` and
        commit the result as the next version.

        Raises:
            ConflictError: the head is no longer ``expected_version``; nothing was written.
            StateValidationError: an unknown field or an invalid result.
        """
        base = await self._base_for(session_id, expected_version)
        previous = self._codec.known_lists(base)
        new_state = self.schema.apply(cast(S, base.state), update, previous=previous)
        return await self._commit(base, new_state, reason=reason, step=step, good=good)

    async def atransact(
        self,
        session_id: str,
        decide: Callable[[S], Mapping[str, Any] | None],
        *,
        reason: str = CheckpointReason.UPDATE,
        step: int | None = None,
        max_attempts: int = 50,
    ) -> Checkpoint[S]:
        """Read, decide, write; on a conflict re-read and decide again (optimistic concurrency).

        ``decide`` gets the latest state and returns the update to apply through the reducers
        (None: nothing to write; the current checkpoint is returned). It may run several times,
        so it must not have side effects.

        Raises:
            ConflictError: still conflicting after ``max_attempts`` attempts.
            StateError: the session does not exist.
        """
        last: ConflictError | None = None
        for attempt in range(max_attempts):
            found = await self._read(session_id, None)
            if found is None:
                raise StateError(f"no state stored for session {session_id!r}")
            base, current = found
            update = decide(current.state)
            if update is None:
                return current
            previous = self._codec.known_lists(base)
            new_state = self.schema.apply(current.state, update, previous=previous)
            try:
                return await self._commit(base, new_state, reason=reason, step=step)
            except ConflictError as exc:
                last = exc
                # Jittered backoff so many writers on one session do not retry in lockstep.
                await pause(secrets.randbelow(1000) / 1_000_000 * min(2**attempt, 64))
        assert last is not None
        raise last

    # --- marks, revert, fork ------------------------------------------------------------------

    async def amark(self, session_id: str, version: int, *, good: bool | None) -> None:
        """Mark a checkpoint good (a revert target) or bad; None clears the mark.

        Raises:
            StateError: that version is not stored.
        """
        backend = self.backend
        if not _storable(version) or not await backend_call(
            backend.mark, backend.amark, session_id, version, good
        ):
            raise StateError(f"session {session_id!r} has no stored version {version}")

    async def arevert(
        self,
        session_id: str,
        *,
        expected_version: int,
        to_version: int | None = None,
        reason: str = CheckpointReason.REVERT,
        step: int | None = None,
    ) -> Checkpoint[S]:
        """Commit the state of ``to_version`` (default: the newest checkpoint marked good) as a
        new version. History is append-only: the reverted versions stay readable.

        Raises:
            ConflictError: the head is no longer ``expected_version``.
            StateError: no such version, or no checkpoint is marked good.
        """
        if to_version is None:
            good = await self.alast_good(session_id)
            if good is None:
                raise StateError(f"session {session_id!r} has no checkpoint marked good")
            to_version = good.version
        target = await self.aat(session_id, to_version)
        base = await self._base_for(session_id, expected_version)
        return await self._commit(
            base,
            target.state,
            reason=f"{reason} to v{to_version}" if reason == CheckpointReason.REVERT else reason,
            step=target.step if step is None else step,
        )

    async def afork(
        self,
        session_id: str,
        new_session_id: str,
        *,
        version: int | None = None,
        ttl: float | timedelta | None = None,
    ) -> Checkpoint[S]:
        """A new session whose version 1 is the state of ``session_id`` at ``version`` (head by
        default). The source session is not changed.

        Raises:
            ConflictError: ``new_session_id`` already exists.
            StateError: no such session or version.
        """
        source = (
            await self.aload(session_id) if version is None else await self.aat(session_id, version)
        )
        return await self.acreate(
            new_session_id,
            source.state,
            ttl=ttl,
            reason=CheckpointReason.FORK,
            step=source.step,
            forked_from=f"{session_id}@{source.version}",
        )

    # --- deleting and retention ---------------------------------------------------------------

    async def adelete(self, session_id: str) -> bool:
        """Delete a session and its history; False when there was none."""
        self._known.forget(session_id)
        return await backend_call(self.backend.delete, self.backend.adelete, session_id)

    def drop_versions(self, session_id: str, versions: Iterable[int]) -> int:
        """Delete these versions of a session's history (the head is always kept), in one
        rewrite; a kept delta whose predecessor goes is rebased as a full snapshot, so every
        kept version stays readable. Returns how many versions were deleted.

        Raises:
            ExpiredError: the session has expired.
        """
        doomed = set(versions)
        now = self.clock()
        rows = self.backend.history(session_id, now)
        if not rows:
            return 0
        keep = {row.version for row in rows if row.version not in doomed}
        keep.add(rows[-1].version)
        if len(keep) == len(rows):
            return 0
        drop_rows(self.backend, session_id, rows, keep, now)
        self._known.forget(session_id)
        return len(rows) - len(keep)

    def vacuum(self) -> VacuumReport:
        """Delete expired sessions and apply the retention policy to every session.

        Retained delta checkpoints whose base is removed are rewritten as full snapshots, so
        every retained version stays readable. The head and the newest good checkpoint are kept.
        """
        report = vacuum(self.backend, self.retention, now=self.clock())
        self._known.clear()
        return report

    async def avacuum(self) -> VacuumReport:
        """Async twin of ``vacuum`` (maintenance: runs off the event loop)."""
        return await run_blocking(self.vacuum)

    # --- leases, storage, closing -------------------------------------------------------------

    def lock(self, session_id: str, *, ttl: float = 30.0, wait: float = 5.0) -> SessionLock:
        """The advisory lease on a session (see ``SessionLock``): ``with store.lock(s):`` (or
        ``async with``) holds it for the block, waiting up to ``wait`` seconds for it
        (``DatabaseLockedError`` after that); unentered, it is a lease object for code that
        manages acquire and release itself."""
        return SessionLock(self.backend, f"session:{session_id}", ttl, self.clock, wait=wait)

    alock = lock
    """The same lease, for ``async with store.alock(session_id):``."""
    session_lock = lock
    """The same lease, unentered: for code that calls ``acquire``/``release`` itself."""

    def storage_bytes(self) -> int:
        """Bytes the backend uses for state."""
        return self.backend.storage_bytes()

    async def aclose(self) -> None:
        """Close the backend."""
        await backend_call(self.backend.close, self.backend.aclose)

    def __enter__(self) -> StateStore[S]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    get = sync_twin(aget)
    load = sync_twin(aload)
    at = sync_twin(aat)
    history = sync_twin(ahistory)
    last_good = sync_twin(alast_good)
    create = sync_twin(acreate)
    checkpoint = sync_twin(acheckpoint)
    append = sync_twin(aappend)
    update = sync_twin(aupdate)
    transact = sync_twin(atransact)
    mark = sync_twin(amark)
    revert = sync_twin(arevert)
    fork = sync_twin(afork)
    delete = sync_twin(adelete)
    close = sync_twin(aclose)


def _storable(version: int) -> bool:
    """Whether a backend could hold ``version`` (versions count from 1)."""
    return 1 <= version <= _LARGEST_VERSION
