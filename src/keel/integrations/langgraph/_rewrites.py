"""What rewrites a thread's stored history: the checkpoints of some runs deleted, each namespace
pruned to its latest checkpoint, a thread copied to a new one (a fork of the whole thread)."""

from __future__ import annotations

from keel.errors import ExpiredError, UsageError
from keel.integrations.langgraph._heads import ThreadHeads
from keel.integrations.langgraph._indexes import ThreadIndexes
from keel.integrations.langgraph._thread import AT, Known, ThreadNames, rows_of

__all__ = ["ThreadRewrites"]


class ThreadRewrites:
    """Rewrites of a saver's threads; the caller holds the session's lock where noted."""

    def __init__(self, heads: ThreadHeads, indexes: ThreadIndexes, names: ThreadNames) -> None:
        self._heads = heads
        self._store = heads.store
        self._indexes = indexes
        self._names = names

    def drop_runs(self, session: str, runs: set[str]) -> None:
        """Delete the checkpoints ``runs`` stored in a session (its lock held); when its latest
        goes, the newest remaining checkpoint becomes the head."""
        try:
            rows = rows_of(self._store.history(session))
        except ExpiredError:
            return
        doomed = {row.checkpoint_id for row in rows if row.run_id in runs}
        doomed.discard(None)
        if not doomed:
            return
        survivors: dict[str, int] = {}
        for row in rows:  # newest first: the first version of an id is its newest state
            if row.checkpoint_id is not None and row.checkpoint_id not in doomed:
                survivors.setdefault(row.checkpoint_id, row.version)
        if not survivors:
            self._store.delete(session)
            self._heads.forget(session)
            return
        known = self._heads.head(session, fresh=True)
        if known is None:
            return
        if known.state.id in doomed or known.state.latest in doomed:
            # The newest remaining checkpoint becomes the head (and the latest).
            latest = max(survivors)
            old = self._store.at(session, survivors[latest]).state
            state = old.model_copy(
                update={
                    "latest": latest,
                    "writes": self._heads.writes_for(session, known, old, rows),
                    "items": known.state.items,
                    "packets": known.state.packets,
                }
            )
            known = self._heads.commit(session, known, state)
        self._store.drop_versions(
            session,
            [row.version for row in rows if row.checkpoint_id in doomed or not row.checkpoint_id],
        )
        self._heads.forget_recent(session)

    def keep_latest(self, session: str) -> None:
        """Keep a session's latest checkpoint with every pending write it has, alone (its lock
        held)."""
        heads = self._heads
        known = heads.head(session, fresh=True)
        if known is None or known.state.latest is None:
            return
        latest = known.state.latest
        if known.state.id != latest:
            # The head is another checkpoint (restated by delete_for_runs): the latest
            # becomes the head, with every write it has.
            old = heads.state_at(session, known, known.state.latest_at)
            pending = {k: e for k, e in known.state.writes.items() if e[AT] > latest}
            state = old.model_copy(
                update={
                    "writes": {**heads.writes_for(session, known, old), **pending},
                    "items": known.state.items,
                    "packets": known.state.packets,
                }
            )
            known = heads.commit(session, known, state)
        older = [
            info.version for info in self._store.history(session) if info.version != known.version
        ]
        self._store.drop_versions(session, older)
        heads.forget_recent(session)

    def copy(self, source_thread_id: str, target_thread_id: str) -> None:
        """Copy every checkpoint and write of a thread, in every namespace, to a new thread.

        Raises:
            UsageError: the target thread already has checkpoints.
        """
        names = self._names
        namespaces = self._indexes.namespaces(source_thread_id)
        for namespace in namespaces:
            if self._store.get(names.session(target_thread_id, namespace)) is not None:
                raise UsageError(f"thread {target_thread_id!r} already has checkpoints")
        for namespace in namespaces:
            source = names.session(source_thread_id, namespace)
            try:
                infos = list(reversed(self._store.history(source)))
            except ExpiredError:
                continue
            if not infos:
                continue
            rows = {row.version: row for row in rows_of(infos)}
            target = names.session(target_thread_id, namespace)
            self._indexes.register_namespace(target_thread_id, namespace)
            known: Known | None = None
            runs: set[str] = set()
            renumbered: dict[int, int] = {}  # the source's versions have gaps once pruned
            with self._heads.lock(target):
                for info in infos:
                    state = self._store.at(source, info.version).state
                    state = state.model_copy(
                        update={"latest_at": renumbered.get(state.latest_at, 0)}
                    )
                    known = self._heads.commit(target, known, state, reason=info.reason)
                    renumbered[info.version] = known.version
                    row = rows.get(info.version)
                    if row is not None and row.run_id is not None:
                        runs.add(row.run_id)
            for run in runs:
                self._indexes.register_run(run, target)
