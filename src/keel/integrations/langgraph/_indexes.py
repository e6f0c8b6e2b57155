"""The indexes of a saver's sessions: each thread's namespaces, and the namespace sessions each
run wrote to (what ``delete_for_runs`` visits). An index may name a session never created (a
crash in between), never miss one that exists."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence

from keel.errors import ConflictError
from keel.integrations.langgraph._thread import ATTEMPTS, Recent, ThreadNames, _Index
from keel.state import StateBackend, StateStore

__all__ = ["ThreadIndexes"]

_RUNS_REMEMBERED = 4096


class ThreadIndexes:
    """Reads and updates the indexes (compare-and-set, retried on a conflict)."""

    def __init__(self, backend: StateBackend, names: ThreadNames, clock: Callable[[], float]):
        # Indexes never expire with a namespace: vacuum() drops the entries of the gone.
        self.store: StateStore[_Index] = StateStore(backend, _Index, clock=clock)
        self._names = names
        self._runs_seen: Recent[tuple[str, str], bool] = Recent(_RUNS_REMEMBERED)

    def add(self, index: str, name: str, *, new: bool = False) -> None:
        """Add ``name`` to an index (``new``: the index most likely does not exist yet, as a
        run's: try to create it before reading it)."""
        if new:
            try:
                self.store.create(index, _Index(names=[name]))
                return
            except ConflictError:
                pass
        for _ in range(ATTEMPTS):
            found = self.store.get(index)
            try:
                if found is None:
                    self.store.create(index, _Index(names=[name]))
                    return
                if name in found.state.names:
                    return
                self.store.checkpoint(
                    index,
                    _Index(names=[*found.state.names, name]),
                    expected_version=found.version,
                    reason="index",
                )
                return
            except ConflictError:
                time.sleep(random.random() / 1000)
        raise ConflictError(index, None, None)

    def register_namespace(self, thread_id: str, namespace: str) -> None:
        """Index a thread's namespace; before its session exists."""
        self.add(self._names.thread_index(thread_id), namespace)

    def register_run(self, run_id: str, session: str) -> None:
        """Index a session a run wrote to (once per process and pair)."""
        seen = (run_id, session)
        if seen in self._runs_seen:
            return
        self.add(self._names.run_index(run_id), session, new=True)
        self._runs_seen.put(seen, True)

    def names(self, index: str) -> list[str]:
        """What an index lists (nothing when it does not exist)."""
        found = self.store.get(index)
        return [] if found is None else list(found.state.names)

    def namespaces(self, thread_id: str) -> list[str]:
        """A thread's namespaces."""
        return self.names(self._names.thread_index(thread_id))

    def delete_run(self, run_id: str) -> None:
        """Delete a run's index."""
        self.store.delete(self._names.run_index(run_id))
        self._runs_seen.drop(lambda seen: seen[0] == run_id)

    def keep_only(self, index: str, names: Sequence[str]) -> None:
        """Keep only ``names`` in an index; an index left empty goes."""
        for _ in range(ATTEMPTS):
            found = self.store.get(index)
            if found is None:
                return
            kept = [name for name in found.state.names if name in names]
            try:
                if not kept:
                    self.store.delete(index)
                elif kept != found.state.names:
                    self.store.checkpoint(
                        index, _Index(names=kept), expected_version=found.version, reason="index"
                    )
                return
            except ConflictError:
                continue
