"""Version bookkeeping of a saver's thread namespaces: each session's head as last read or
written, the version of each checkpoint, compare-and-set commits, and the run-mark fence."""

from __future__ import annotations

import threading
from typing import Any

from keel.errors import ExpiredError
from keel.integrations.langgraph._codec import ThreadCodec
from keel.integrations.langgraph._thread import (
    CACHED_SESSIONS,
    Known,
    Recent,
    Row,
    RunMark,
    StaleWriterError,
    ThreadNames,
    ThreadState,
    reason_of,
    rows_of,
    writes_of,
)
from keel.state import StateStore

__all__ = ["ThreadHeads"]

_RECENT_CHECKPOINTS = 4096


class ThreadHeads:
    """The heads of a saver's namespace sessions and the versions of their checkpoints.

    Writers of one session take turns through ``lock(session)`` (striped locks); every commit
    is compare-and-set on the version the writer holds all the same.
    """

    def __init__(self, store: StateStore[ThreadState], codec: ThreadCodec, names: ThreadNames):
        self.store = store
        self._codec = codec
        self._names = names
        self._known: Recent[str, Known] = Recent(CACHED_SESSIONS)
        self._recent: Recent[tuple[str, str], int] = Recent(_RECENT_CHECKPOINTS)
        """(session, checkpoint id) -> the version last written with that checkpoint."""
        self._locks = [threading.Lock() for _ in range(64)]

    def lock(self, session: str) -> threading.Lock:
        """The lock writers of ``session`` in this process take turns through."""
        return self._locks[hash(session) % len(self._locks)]

    def head(self, session: str, *, fresh: bool) -> Known | None:
        """The session's head (read again with ``fresh``, else as last known); None when the
        session does not exist or has expired."""
        if not fresh:
            cached = self._known.get(session)
            if cached is not None:
                return cached
        try:
            found = self.store.get(session)
        except ExpiredError:
            found = None
        if found is None:
            self._known.pop(session)
            return None
        return self._known.put(session, Known(found.version, found.state))

    def forget(self, session: str) -> None:
        """Forget what is known of a session (deleted)."""
        self._known.pop(session)
        self._codec.forget(session)
        self.forget_recent(session)

    def forget_recent(self, session: str) -> None:
        """Forget the versions recorded for a session's checkpoints (its history was
        rewritten)."""
        self._recent.drop(lambda key: key[0] == session)

    def clear(self) -> None:
        """Forget what is known of every session (after a vacuum)."""
        self._known.clear()
        self._codec.clear()
        self._recent.clear()

    def commit(
        self,
        session: str,
        known: Known | None,
        state: ThreadState,
        run_id: str | None = None,
        reason: str | None = None,
    ) -> Known:
        """Write ``state`` as the version after ``known`` (compare-and-set) and cache it. A
        version holding the latest checkpoint's state becomes where readers find it."""
        version = known.version + 1 if known is not None else 1
        if state.id is not None and state.id == state.latest and state.latest_at != version:
            state = state.model_copy(update={"latest_at": version})
        reason = reason or reason_of(state, run_id)
        if known is None:
            self.store.create(session, state, reason=reason)
        else:
            self.store.checkpoint(session, state, expected_version=known.version, reason=reason)
        committed = self._known.put(session, Known(version, state))
        if state.id is not None:
            self._recent.put((session, state.id), version)
        return committed

    def version_of(self, session: str, known: Known, checkpoint_id: str) -> int | None:
        """The newest version holding a checkpoint's state (a version that only adds writes
        restates the head), or None when the namespace has no such checkpoint."""
        if known.state.id == checkpoint_id:
            return known.version
        if known.state.latest == checkpoint_id:
            return known.state.latest_at
        recent = self._recent.get((session, checkpoint_id))
        if recent is not None and recent <= known.version:
            return recent
        for row in rows_of(self.store.history(session)):
            if row.checkpoint_id == checkpoint_id:
                return row.version
        return None

    def writes_for(
        self, session: str, known: Known, state: ThreadState, rows: list[Row] | None = None
    ) -> dict[str, list[Any]]:
        """A checkpoint's pending writes. Those stored once it was no longer the head (a
        task's late write after the next checkpoint's put, a fork's first writes) are in the
        versions after it: its children's newest versions and the head."""
        writes = writes_of(state.writes, state.id)
        if state.id == known.state.id:
            return writes
        newest_child: dict[str, int] = {}
        for row in rows if rows is not None else rows_of(self.store.history(session)):
            if row.parent == state.id and row.checkpoint_id is not None:
                newest_child.setdefault(row.checkpoint_id, row.version)
        later = [self.state_at(session, known, v) for v in sorted(newest_child.values())]
        for holder in [*later, known.state]:
            for key, entry in writes_of(holder.writes, state.id).items():
                writes.setdefault(key, entry)
        return writes

    def state_at(self, session: str, known: Known, version: int) -> ThreadState:
        """The state stored at ``version`` (``StateError`` when it is not stored)."""
        if version == known.version:
            return known.state
        return self.store.at(session, version).state

    def check_mark(
        self, session: str, known: Known | None, mark: RunMark | None, parent: str | None = None
    ) -> Known | None:
        """Raise ``StaleWriterError`` when a marked run is no longer current (or a put of it
        does not extend the latest checkpoint); the head it was checked against otherwise."""
        if mark is None:
            return known
        for fresh in (False, True):
            if fresh:
                known = self.head(session, fresh=True)
            latest = known.state.latest if known is not None else None
            if latest is None:
                if known is None and fresh:
                    thread, namespace = self._names.parse_session(session)
                    raise StaleWriterError(thread, namespace, mark.read, "(deleted)")
                continue
            assert known is not None
            current = latest == mark.read or known.state.by == mark.writer
            if current and (parent is None or parent == latest):
                return known
        thread, namespace = self._names.parse_session(session)
        raise StaleWriterError(thread, namespace, mark.read, str(latest))
