"""A LangGraph checkpointer on keel's state stores.

Each (thread, namespace) of a graph is one keel state session whose versions are the thread's
checkpoints and pending writes, in the order they were written. keel's store does the rest:

- **What changed only.** A checkpoint is stored as a delta against the version before it: a
  message list that grew by one message stores that message, not the list again (LangGraph's
  own savers store every channel that changed whole, so a long thread's database grows with
  the square of its length).
- **A stale writer is rejected.** ``get_tuple`` of a thread's latest checkpoint marks the run
  that read it; LangGraph carries the mark into that run's puts and writes. Once another
  writer has stored a newer checkpoint, the stale run's next put or write raises
  [`StaleWriterError`][] and stores nothing, and a newer checkpoint keeps only the pending
  writes of the run that stored it.
- **Retention that keeps resume working.** ``prune(strategy="keep_latest")`` keeps each
  namespace's latest checkpoint with its pending writes, rebased as a full snapshot in one
  atomic rewrite; ``ttl`` expires a whole namespace after that long without a write, never a
  part of one.
- **PII masked before it is stored**: the text in channel values, pending writes and metadata
  (ids, names and types kept). With a PII vault (``vault=``), each value is stored sealed in
  the vault and the checkpoint holds the user's stable placeholder for it; a read gives the
  graph that user's values back, so a graph resumed from keel's checkpoints runs its tools
  with the values LangGraph's own savers would have given it, and nothing raw is stored.

Explicit time travel (``checkpoint_id`` in the config) forks as LangGraph defines it: a put on
an older checkpoint is a new branch, not a conflict, whatever config named it (one from
``get_state_history``, or from a ``get_state`` snapshot taken before the thread moved on: a
read of a named checkpoint clears the mark such a config carries). Only a run that read "the
latest" is fenced. A thread's very first checkpoint has no run mark to check against.

The saver itself follows LangGraph's ``BaseCheckpointSaver`` API; its machinery lives in objects
of its own: ``ThreadCodec`` (serialization, masking, list channels), ``ThreadHeads`` (heads,
versions, commits, the run-mark fence), ``ThreadIndexes`` (thread and run indexes) and
``ThreadRewrites`` (runs deleted, pruning, copies).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any
from urllib.parse import quote, unquote

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    WRITES_IDX_MAP,
    BaseCheckpointSaver,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
    get_checkpoint_metadata,
)
from langgraph.checkpoint.serde.base import SerializerProtocol

from keel._bridge import run_blocking
from keel.errors import (
    AccessDeniedError,
    ConflictError,
    ExpiredError,
    StateError,
    UsageError,
    VaultKeyError,
)
from keel.integrations._privacy import NEEDS_VAULT, open_history_stores
from keel.integrations.langgraph._codec import ThreadCodec
from keel.integrations.langgraph._heads import ThreadHeads
from keel.integrations.langgraph._indexes import ThreadIndexes
from keel.integrations.langgraph._rewrites import ThreadRewrites
from keel.integrations.langgraph._thread import (
    AT,
    ATTEMPTS,
    RUN_MARK,
    WRITER,
    Known,
    Row,
    RunMark,
    StaleWriterError,
    ThreadNames,
    ThreadState,
    checkpoint_ids,
    merged_writes,
    rows_of,
    run_mark_of,
)
from keel.privacy import DEFAULT_MASKER, PIIMasker, Vault, privacy_view
from keel.state import StateBackend, StateStore, VacuumReport
from keel.stores import Backends

__all__ = ["KeelCheckpointSaver", "StaleWriterError", "ThreadState"]


class KeelCheckpointSaver(BaseCheckpointSaver[int]):
    """A LangGraph ``BaseCheckpointSaver`` (sync and async) on a keel state backend.

    Args:
        backend: a state backend URL (``sqlite:///keel.db``, ``postgresql://...``,
            ``redis://...``) or a ``StateBackend``.
        tenant: every thread this saver reads or writes belongs to this tenant.
        masker: masks PII before anything is stored (default: the one default policy,
            ``keel.privacy.DEFAULT_MASKER``).
        ttl: a thread namespace expires this long after its last write (None: never).
        snapshot_every: passed to ``StateStore`` (fewest versions between full snapshots).
        serde: LangGraph's serializer for channel values (default ``JsonPlusSerializer``).
        clock: seconds since the epoch, for tests of expiry.
        vault: the PII vault: values are stored there sealed, checkpoints hold the user's
            placeholders, and reads give the user their values back. Not given, and
            ``backend`` a SQL URL: the vault ``Backends.open`` opens on that database
            (``KEEL_PII_KEY`` / ``KEEL_PII_KEY_FILE``; neither set, on SQLite keel's own key
            file in the config directory; ``KEEL_PII_VAULT=off``: masking alone).
        user: whose values a thread holds when its config says nothing:
            ``config["configurable"]["user_id"]`` names the user; without it, this; without
            both, the thread id (each thread its own user).

    Raises:
        VaultKeyError: the PII key is malformed or not the vault's, or a PostgreSQL database
            holds a vault and no key is given.
    """

    def __init__(
        self,
        backend: StateBackend | str,
        *,
        tenant: str = "default",
        masker: PIIMasker | None = None,
        ttl: float | timedelta | None = None,
        snapshot_every: int = 100,
        serde: SerializerProtocol | None = None,
        clock: Callable[[], float] = time.time,
        vault: Vault | None = None,
        user: str | None = None,
    ) -> None:
        super().__init__(serde=serde)
        if not tenant:
            raise UsageError("a tenant must not be empty")
        # The stores opened from a URL, closed with the saver; a backend passed in is closed
        # by the saver's close as before.
        self._backends: Backends | None = None
        if isinstance(backend, str):
            self._backends = open_history_stores(backend, vault)
            backend = self._backends.state.backend
            vault = vault if vault is not None else self._backends.vault
        self.backend: StateBackend = backend
        self.vault = vault
        self.tenant = tenant
        self.user = user
        self.masker = DEFAULT_MASKER if masker is None else masker
        self.store: StateStore[ThreadState] = StateStore(
            self.backend, ThreadState, snapshot_every=snapshot_every, default_ttl=ttl, clock=clock
        )
        self._names = ThreadNames(tenant)
        self._codec = ThreadCodec(self.serde, self.masker, tenant)
        self._heads = ThreadHeads(self.store, self._codec, self._names)
        self._indexes = ThreadIndexes(self.backend, self._names, clock)
        self._rewrites = ThreadRewrites(self._heads, self._indexes, self._names)

    # --- writing ------------------------------------------------------------------------------

    def put(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        """Store a checkpoint as the change since the one before it (compare-and-set).

        Raises:
            StaleWriterError: the run this put belongs to started from a checkpoint another
                writer has stored a newer one since.
        """
        thread_id, namespace, parent = checkpoint_ids(config)
        mark = run_mark_of(config, namespace)
        session = self._names.session(thread_id, namespace)
        full_metadata = get_checkpoint_metadata(config, metadata)
        run_id = full_metadata.get("run_id")
        run = str(run_id) if run_id is not None else None
        heads = self._heads
        with heads.lock(session):
            known = heads.head(session, fresh=False)
            for _ in range(ATTEMPTS):
                known = heads.check_mark(session, known, mark, parent)
                codec = self._writing_codec(config, thread_id, known)
                if known is None:
                    self._indexes.register_namespace(thread_id, namespace)
                try:
                    if known is not None and mark is not None:
                        known = self._drop_other_writers(session, known, mark)
                    state = codec.checkpoint_state(
                        session,
                        known.state if known is not None else None,
                        checkpoint,
                        full_metadata,
                        new_versions,
                        parent,
                        mark,
                    )
                    heads.commit(session, known, state, run)
                    codec.settle(session)
                    break
                except ConflictError as exc:
                    if isinstance(exc, StaleWriterError):
                        raise
                    known = heads.head(session, fresh=True)
            else:
                raise ConflictError(session, None, None)
        if run is not None:
            self._indexes.register_run(run, session)
        return {
            "configurable": {
                "thread_id": thread_id,
                "checkpoint_ns": namespace,
                "checkpoint_id": checkpoint["id"],
            }
        }

    def _drop_other_writers(self, session: str, known: Known, mark: RunMark) -> Known:
        """Before a marked run extends the latest checkpoint: that checkpoint keeps only this
        run's pending writes (and unmarked ones), restated as a new version when another run
        wrote to it too, so the loser's results are nowhere to be read."""
        writes = known.state.writes
        kept = {
            key: entry
            for key, entry in writes.items()
            if entry[AT] != known.state.id or entry[WRITER] in ("", mark.writer)
        }
        if len(kept) == len(writes):
            return known
        state = known.state.model_copy(update={"writes": kept})
        return self._heads.commit(session, known, state)

    def put_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        """Store a task's writes as pending writes of the config's checkpoint.

        Writes may arrive before their checkpoint is stored (LangGraph saves in the
        background); they are held until it is.

        Raises:
            StaleWriterError: as ``put``.
        """
        thread_id, namespace, target = checkpoint_ids(config)
        if target is None:
            raise UsageError("put_writes needs configurable.checkpoint_id")
        mark = run_mark_of(config, namespace)
        writer = mark.writer if mark is not None else ""
        session = self._names.session(thread_id, namespace)
        heads = self._heads
        with heads.lock(session):
            known = heads.head(session, fresh=False)
            for _ in range(ATTEMPTS):
                known = heads.check_mark(session, known, mark)
                codec = self._writing_codec(config, thread_id, known)
                refs = codec.refs(session, known.state.items if known is not None else [])
                entries: dict[str, list[Any]] = {}
                for position, (channel, value) in enumerate(writes):
                    index = WRITES_IDX_MAP.get(channel, position)
                    key = f"{target}\x1f{task_id}\x1f{index}" + (f"\x1f{writer}" if writer else "")
                    text = codec.encode(value, refs)
                    entries[key] = [target, task_id, channel, text, task_path, index, writer]
                try:
                    if known is None:
                        self._indexes.register_namespace(thread_id, namespace)
                        state = ThreadState(writes=entries, owner=codec.owner)
                        heads.commit(session, None, state)
                        codec.settle(session)
                        return
                    # The head with a task's writes added (of its own checkpoint, of one whose
                    # put is still on its way, or of an older one: a late write, a fork's first
                    # step).
                    merged = merged_writes(known.state.writes, entries)
                    if merged is not None:
                        state = known.state.model_copy(update={"writes": merged})
                        heads.commit(session, known, state)
                        codec.settle(session)
                    return
                except ConflictError as exc:
                    if isinstance(exc, StaleWriterError):
                        raise
                    known = heads.head(session, fresh=True)
            raise ConflictError(session, None, None)

    # --- reading ------------------------------------------------------------------------------

    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        """The config's checkpoint (the latest when it names none), with its pending writes."""
        thread_id, namespace, checkpoint_id = checkpoint_ids(config)
        session = self._names.session(thread_id, namespace)
        heads = self._heads
        with heads.lock(session):
            known = heads.head(session, fresh=True)
            if known is None or known.state.latest is None:
                return None
            target = checkpoint_id or known.state.latest
            version = heads.version_of(session, known, target)
            if version is None:
                return None
            try:
                state = heads.state_at(session, known, version)
            except StateError:
                return None  # removed by a concurrent prune
            mark = RunMark(namespace, uuid.uuid4().hex, target) if checkpoint_id is None else None
            writes = heads.writes_for(session, known, state)
            found = self._reading_codec(config, thread_id, known).tuple_of(
                thread_id, namespace, state, writes, known.state.items, session, mark
            )
            if checkpoint_id is not None:
                # A run from a named checkpoint is a fork. LangGraph merges this config over
                # the caller's, which may carry the mark of the read that produced it (a
                # ``get_state`` snapshot's config): cleared, the fork is never fenced by it.
                found.config["configurable"][RUN_MARK] = None
            return found

    def _user_of(self, config: RunnableConfig | None, thread_id: str) -> str:
        configurable = (config or {}).get("configurable") or {}
        return str(configurable.get("user_id") or self.user or thread_id)

    def _reading_codec(
        self, config: RunnableConfig | None, thread_id: str, known: Known
    ) -> ThreadCodec:
        """The codec a read decodes with: revealing the values of the namespace's owner to
        that user alone (anyone else, or a namespace stored without a vault: placeholders)."""
        user = self._user_of(config, thread_id)
        if self.vault is None or known.state.owner != user:
            return self._codec
        return self._codec.view(privacy_view(self.masker, self.tenant, user, self.vault))

    def _writing_codec(
        self, config: RunnableConfig | None, thread_id: str, known: Known | None
    ) -> ThreadCodec:
        """The codec a write encodes with: the user's vault numbering for a namespace of
        theirs (or a new one, theirs from now on); masking alone for one stored without a
        vault.

        Raises:
            AccessDeniedError: the namespace holds another user's values.
            VaultKeyError: it holds a user's values and this saver has no vault (its
                placeholders, numbered per text, would read back as other values).
        """
        owner = known.state.owner if known is not None else None
        if self.vault is None:
            if owner:
                raise VaultKeyError(NEEDS_VAULT.format(f"thread {thread_id!r}"))
            return self._codec
        user = self._user_of(config, thread_id)
        owner = user if owner is None else owner
        if owner == "":
            return self._codec
        if owner != user:
            raise AccessDeniedError(
                f"thread {thread_id!r} holds another user's values; {user!r} cannot write to it"
            )
        return self._codec.view(privacy_view(self.masker, self.tenant, user, self.vault))

    def _sessions_of(self, config: RunnableConfig | None) -> list[str]:
        names = self._names
        if config is None or "thread_id" not in (config.get("configurable") or {}):
            return [s for s in self.store.sessions() if s.startswith(names.prefix)]
        configurable = config["configurable"]
        thread_id = str(configurable["thread_id"])
        if "checkpoint_ns" in configurable:
            return [names.session(thread_id, str(configurable["checkpoint_ns"] or ""))]
        return [names.session(thread_id, ns) for ns in self._indexes.namespaces(thread_id)]

    def list(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> Iterator[CheckpointTuple]:
        """Checkpoints newest first (by id), filtered by metadata, before a cursor, at most
        ``limit``."""
        before_id = ((before or {}).get("configurable") or {}).get("checkpoint_id")
        candidates: list[tuple[str, str, int]] = []
        listings: dict[str, list[Row]] = {}
        for session in self._sessions_of(config):
            try:
                rows = listings[session] = rows_of(self.store.history(session))
            except ExpiredError:
                continue
            newest: dict[str, int] = {}
            for row in rows:  # newest first: the first version of an id is its newest state
                if row.checkpoint_id is not None:
                    newest.setdefault(row.checkpoint_id, row.version)
            candidates.extend(
                (checkpoint_id, session, version)
                for checkpoint_id, version in newest.items()
                if before_id is None or checkpoint_id < before_id
            )
        candidates.sort(reverse=True)
        returned = 0
        heads: dict[str, Known | None] = {}
        codecs: dict[str, ThreadCodec] = {}
        for _checkpoint_id, session, version in candidates:
            if limit is not None and returned >= limit:
                return
            if session not in heads:
                heads[session] = self._heads.head(session, fresh=True)
            known = heads[session]
            try:
                if known is None:
                    continue
                state = self._heads.state_at(session, known, version)
            except (StateError, ExpiredError):
                continue  # pruned since the listing
            thread_id, namespace = self._names.parse_session(session)
            codec = codecs.get(session) or codecs.setdefault(
                session, self._reading_codec(config, thread_id, known)
            )
            if filter:
                metadata = codec.decode(state.meta)
                if any(metadata.get(key) != value for key, value in filter.items()):
                    continue
            writes = self._heads.writes_for(session, known, state, listings[session])
            yield codec.tuple_of(thread_id, namespace, state, writes, known.state.items, None, None)
            returned += 1

    def count_checkpoints(self, thread_id: str) -> int:
        """How many checkpoints a thread has stored, in every namespace, counted from the
        stored history (nothing is decoded)."""
        count = 0
        for namespace in self._indexes.namespaces(thread_id):
            try:
                rows = rows_of(self.store.history(self._names.session(thread_id, namespace)))
            except ExpiredError:
                continue
            count += len({row.checkpoint_id for row in rows if row.checkpoint_id is not None})
        return count

    # --- deleting, copying, pruning -----------------------------------------------------------

    def delete_thread(self, thread_id: str) -> None:
        """Delete every checkpoint and write of a thread, in every namespace."""
        for namespace in self._indexes.namespaces(thread_id):
            session = self._names.session(thread_id, namespace)
            with self._heads.lock(session):
                self.store.delete(session)
                self._heads.forget(session)
        self._indexes.store.delete(self._names.thread_index(thread_id))

    def delete_for_runs(self, run_ids: Sequence[str]) -> None:
        """Delete the checkpoints (and their writes) the given runs stored, in every thread; a
        namespace whose latest checkpoint goes falls back to its newest remaining one."""
        doomed_runs = {str(run_id) for run_id in run_ids}
        for run_id in doomed_runs:
            index = self._names.run_index(run_id)
            if self._indexes.store.get(index) is None:
                continue
            for session in self._indexes.names(index):
                with self._heads.lock(session):
                    self._rewrites.drop_runs(session, doomed_runs)
            self._indexes.delete_run(run_id)

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Copy every checkpoint and write of a thread, in every namespace, to a new thread.

        Raises:
            UsageError: the target thread already has checkpoints.
        """
        self._rewrites.copy(source_thread_id, target_thread_id)

    def prune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        """``keep_latest``: each namespace keeps its latest checkpoint with its pending writes
        (rebased as a full snapshot, in one atomic rewrite); ``delete``: threads are deleted.

        Raises:
            UsageError: an unknown strategy.
        """
        if strategy not in ("keep_latest", "delete"):
            raise UsageError(f"unknown prune strategy {strategy!r}: keep_latest or delete")
        for thread_id in thread_ids:
            if strategy == "delete":
                self.delete_thread(thread_id)
                continue
            for namespace in self._indexes.namespaces(thread_id):
                session = self._names.session(thread_id, namespace)
                with self._heads.lock(session):
                    self._rewrites.keep_latest(session)

    def vacuum(self) -> VacuumReport:
        """Delete expired sessions of the backend (this saver's namespaces after ``ttl``), then
        this tenant's index entries that name what is gone (an index left empty goes too)."""
        report = self.store.vacuum()
        self._heads.clear()
        sessions = set(self.store.sessions())
        tenant = quote(self.tenant, safe="")
        for index in sorted(sessions):
            if index.startswith(f"langgraph-thread/{tenant}/"):
                thread_id = unquote(index.rsplit("/", 1)[1])
                alive = [
                    n
                    for n in self._indexes.namespaces(thread_id)
                    if self._names.session(thread_id, n) in sessions
                ]
            elif index.startswith(f"langgraph-run/{tenant}/"):
                alive = [n for n in self._indexes.names(index) if n in sessions]
            else:
                continue
            self._indexes.keep_only(index, alive)
        return report

    # --- async twins: the sync methods off the event loop -------------------------------------

    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        return await run_blocking(self.get_tuple, config)

    async def alist(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> AsyncIterator[CheckpointTuple]:
        found = await run_blocking(
            lambda: list(self.list(config, filter=filter, before=before, limit=limit))
        )
        for item in found:
            yield item

    async def aput(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        return await run_blocking(self.put, config, checkpoint, metadata, new_versions)

    async def aput_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        await run_blocking(self.put_writes, config, writes, task_id, task_path)

    async def adelete_thread(self, thread_id: str) -> None:
        await run_blocking(self.delete_thread, thread_id)

    async def adelete_for_runs(self, run_ids: Sequence[str]) -> None:
        await run_blocking(self.delete_for_runs, run_ids)

    async def acopy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        await run_blocking(self.copy_thread, source_thread_id, target_thread_id)

    async def aprune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        await run_blocking(self.prune, thread_ids, strategy=strategy)

    def close(self) -> None:
        """Release the backend's connections."""
        try:
            self.store.close()
        finally:
            if self._backends is not None:
                self._backends.close()

    async def aclose(self) -> None:
        """Async twin of `close`, off the event loop."""
        await run_blocking(self.close)

    def __enter__(self) -> KeelCheckpointSaver:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def __aenter__(self) -> KeelCheckpointSaver:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
