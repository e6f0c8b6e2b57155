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
  :class:`StaleWriterError` and stores nothing, and a newer checkpoint keeps only the pending
  writes of the run that stored it.
- **Retention that keeps resume working.** ``prune(strategy="keep_latest")`` keeps each
  namespace's latest checkpoint with its pending writes, rebased as a full snapshot in one
  atomic rewrite; ``ttl`` expires a whole namespace after that long without a write, never a
  part of one.
- **PII masked before it is stored**: the text in channel values, pending writes and metadata
  (ids, names and types kept).

Explicit time travel (``checkpoint_id`` in the config) forks as LangGraph defines it: a put on
an older checkpoint is a new branch, not a conflict. A thread's very first checkpoint has no
run mark to check against.
"""

from __future__ import annotations

import asyncio
import base64
import json
import random
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, cast
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
    writes_sort_key,
)
from langgraph.checkpoint.serde.base import SerializerProtocol
from pydantic import BaseModel, Field

from keel.errors import ConflictError, ExpiredError, StateError, UsageError
from keel.privacy import PIIMasker
from keel.state import StateBackend, StateStore, VacuumReport
from keel.stores import open_state_backend

__all__ = ["KeelCheckpointSaver", "StaleWriterError", "ThreadState"]

_RUN_MARK = "__keel_run__"
"""The configurable key ``get_tuple`` of a latest checkpoint adds: ``[namespace, writer
token, id read]``. LangGraph merges the loaded config into the run's, so every put and write
of that run carries it; the ``__`` prefix keeps it out of checkpoint metadata."""

_REASON = "langgraph "
_KEPT_TEXT = frozenset({"id", "tool_call_id", "name", "type", "role", "run_id"})
"""Fields whose text is an identifier, never masked (a masked id would break pairing)."""
_ATTEMPTS = 50
_MISSING = object()
_CACHED_SESSIONS = 256


class StaleWriterError(ConflictError):
    """A run wrote to a thread after another writer stored a newer checkpoint than the one the
    run started from; nothing of this write was stored."""

    def __init__(self, thread_id: str, checkpoint_ns: str, read: str | None, latest: str) -> None:
        ConflictError.__init__(self, thread_id, None, None)
        self.thread_id = thread_id
        self.checkpoint_ns = checkpoint_ns
        self.read = read
        self.latest = latest
        self.args = (
            f"thread {thread_id!r} (namespace {checkpoint_ns!r}): this run started from "
            f"checkpoint {read}, but another writer has stored {latest} since; nothing of this "
            "write was stored. Re-run from the latest checkpoint.",
        )

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(frozen=True)
class _RunMark:
    namespace: str
    writer: str
    read: str


class ThreadState(BaseModel):
    """What one version of a thread namespace stores: one checkpoint (the latest, or an older
    one restated with writes added to it), its pending writes, and where the latest is.

    List channels live in ``items``, every item text the namespace has stored, append-only (a
    list's growth is stored as its new items alone); ``lists`` names each list channel's items
    as runs ``[start, end)`` into it: usually one run, restated in a few bytes per step."""

    id: str | None = None
    parent: str | None = None
    v: int = 1
    ts: str = ""
    versions: dict[str, Any] = Field(default_factory=dict)
    seen: dict[str, dict[str, Any]] = Field(default_factory=dict)
    updated: list[str] | None = None
    meta: str = ""
    by: str = ""
    """The writer token of the run that stored the checkpoint ("" unmarked)."""
    latest: str | None = None
    latest_at: int = 0
    """The version holding the latest checkpoint's newest state."""
    scalars: dict[str, str] = Field(default_factory=dict)
    items: list[str] = Field(default_factory=list)
    lists: dict[str, list[list[int]]] = Field(default_factory=dict)
    writes: dict[str, list[Any]] = Field(default_factory=dict)
    """Pending writes of this checkpoint, and of newer ones whose put is still on its way
    (LangGraph saves in the background): checkpoint, task, channel, value text, task path,
    index, writer token. A put keeps the entries of its checkpoint and newer ones as they are
    (nothing restated) and drops the older ones, which stay in the versions before it."""


@dataclass(frozen=True)
class _Known:
    """A session's head as this saver last read or wrote it."""

    version: int
    state: ThreadState


@dataclass
class _ListCodecs:
    """A session's list channels as last encoded and decoded: an item object to its stored
    text, a stored text to its decoded object. LangGraph keeps a list's old items as the same
    objects from step to step, so a put encodes only the new items, the store sees the old
    texts as its own list's (and stores the appended tail only), and a read decodes only texts
    it has not seen. An item is taken as unchanged while it is the same object."""

    encoded: dict[str, dict[int, tuple[Any, str]]] = field(default_factory=dict)
    decoded: dict[str, dict[str, Any]] = field(default_factory=dict)
    positions: dict[str, int] = field(default_factory=dict)
    """An item text to its position in ``items`` (built once per session and process)."""
    indexed: int = 0
    """How many of ``items`` ``positions`` covers."""


class _Index(BaseModel):
    """A thread's namespaces, or the namespaces a run wrote to."""

    names: list[str] = Field(default_factory=list)


def _reason(checkpoint_id: str | None, run_id: str | None) -> str:
    return _REASON + json.dumps([checkpoint_id, run_id])


def _parse_reason(reason: str) -> tuple[str | None, str | None]:
    if not reason.startswith(_REASON):
        return None, None
    try:
        checkpoint_id, run_id = json.loads(reason[len(_REASON) :])
    except (ValueError, TypeError):
        return None, None
    return checkpoint_id, run_id


def _ids(config: RunnableConfig) -> tuple[str, str, str | None]:
    configurable = config.get("configurable") or {}
    if "thread_id" not in configurable:
        raise UsageError("a LangGraph checkpoint config needs configurable.thread_id")
    return (
        str(configurable["thread_id"]),
        str(configurable.get("checkpoint_ns") or ""),
        configurable.get("checkpoint_id"),
    )


def _run_mark(config: RunnableConfig, namespace: str) -> _RunMark | None:
    raw = (config.get("configurable") or {}).get(_RUN_MARK)
    if isinstance(raw, list | tuple) and len(raw) == 3 and raw[0] == namespace:
        return _RunMark(str(raw[0]), str(raw[1]), str(raw[2]))
    return None  # no mark, or a parent graph's mark inherited by a subgraph


_AT, _TASK, _CHANNEL, _VALUE, _PATH, _INDEX, _WRITER = range(7)
"""Positions in a pending-write entry."""


def _writes_of(writes: dict[str, list[Any]], checkpoint_id: str | None) -> dict[str, list[Any]]:
    return {key: entry for key, entry in writes.items() if entry[_AT] == checkpoint_id}


def _merged_writes(
    existing: dict[str, list[Any]], new: dict[str, list[Any]]
) -> dict[str, list[Any]] | None:
    """``existing`` with ``new`` added (a write already stored for its task and index is kept,
    except the special channels LangGraph overwrites); None when nothing changes."""
    merged = dict(existing)
    changed = False
    for key, entry in new.items():
        if key in merged and (entry[_INDEX] >= 0 or merged[key] == entry):
            continue
        merged[key] = entry
        changed = True
    return merged if changed else None


class KeelCheckpointSaver(BaseCheckpointSaver[int]):
    """A LangGraph ``BaseCheckpointSaver`` (sync and async) on a keel state backend.

    Args:
        backend: a state backend URL (``sqlite:///keel.db``, ``postgresql://...``,
            ``redis://...``) or a ``StateBackend``.
        tenant: every thread this saver reads or writes belongs to this tenant.
        masker: masks PII before anything is stored (default ``PIIMasker()``).
        ttl: a thread namespace expires this long after its last write (None: never).
        snapshot_every: passed to ``StateStore`` (fewest versions between full snapshots).
        serde: LangGraph's serializer for channel values (default ``JsonPlusSerializer``).
        clock: seconds since the epoch, for tests of expiry.
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
    ) -> None:
        super().__init__(serde=serde)
        if not tenant:
            raise UsageError("a tenant must not be empty")
        self.backend = open_state_backend(backend) if isinstance(backend, str) else backend
        self.tenant = tenant
        self.masker = PIIMasker() if masker is None else masker
        self.store: StateStore[ThreadState] = StateStore(
            self.backend, ThreadState, snapshot_every=snapshot_every, default_ttl=ttl, clock=clock
        )
        # Indexes never expire with a namespace: vacuum() drops the entries of the gone.
        self._index: StateStore[_Index] = StateStore(self.backend, _Index, clock=clock)
        self._known: OrderedDict[str, _Known] = OrderedDict()
        self._codecs: OrderedDict[str, _ListCodecs] = OrderedDict()
        self._known_lock = threading.Lock()
        self._locks = [threading.Lock() for _ in range(64)]
        self._runs_seen: OrderedDict[tuple[str, str], None] = OrderedDict()

    # --- naming -------------------------------------------------------------------------------

    def _prefix(self) -> str:
        return f"langgraph/{quote(self.tenant, safe='')}/"

    def _session(self, thread_id: str, namespace: str) -> str:
        return f"{self._prefix()}{quote(thread_id, safe='')}/{quote(namespace, safe='')}"

    def _thread_index(self, thread_id: str) -> str:
        return f"langgraph-thread/{quote(self.tenant, safe='')}/{quote(thread_id, safe='')}"

    def _run_index(self, run_id: str) -> str:
        return f"langgraph-run/{quote(self.tenant, safe='')}/{quote(run_id, safe='')}"

    def _parse_session(self, session: str) -> tuple[str, str]:
        thread, namespace = session[len(self._prefix()) :].split("/")
        return unquote(thread), unquote(namespace)

    def _lock(self, session: str) -> threading.Lock:
        return self._locks[hash(session) % len(self._locks)]

    # --- encoding -----------------------------------------------------------------------------

    def _masked(self, value: Any, key: str | None = None) -> Any:
        """``value`` with its text masked; the very same object when nothing needed masking."""
        if isinstance(value, str):
            if key in _KEPT_TEXT:
                return value
            return self.masker.mask_text(value, tenant_id=self.tenant)
        if isinstance(value, BaseModel):
            changes = {}
            for name in type(value).model_fields:
                current = getattr(value, name, None)
                masked = self._masked(current, name)
                if masked is not current:
                    changes[name] = masked
            return value.model_copy(update=changes) if changes else value
        if type(value) is dict:
            entries = {
                k: self._masked(v, k if isinstance(k, str) else None) for k, v in value.items()
            }
            return entries if any(entries[k] is not v for k, v in value.items()) else value
        if type(value) is list or type(value) is tuple:
            items = [self._masked(item, key) for item in value]
            if all(new is old for new, old in zip(items, value, strict=True)):
                return value
            return items if type(value) is list else tuple(items)
        return value

    def _encode(self, value: Any) -> str:
        kind, data = self.serde.dumps_typed(self._masked(value))
        return f"{kind}:{base64.b64encode(data).decode('ascii')}"

    def _decode(self, text: str) -> Any:
        kind, _, data = text.partition(":")
        return self.serde.loads_typed((kind, base64.b64decode(data)))

    def _list_codecs(self, session: str) -> _ListCodecs:
        with self._known_lock:
            codecs = self._codecs.get(session)
            if codecs is None:
                codecs = self._codecs[session] = _ListCodecs()
            self._codecs.move_to_end(session)
            while len(self._codecs) > _CACHED_SESSIONS:
                self._codecs.popitem(last=False)
            return codecs

    def _encode_list(
        self,
        session: str,
        base: ThreadState | None,
        channel: str,
        values: list[Any],
        stored: list[str],
    ) -> tuple[list[list[int]], list[str]]:
        """A list channel as runs into ``stored`` (the namespace's ``items``, with what this
        put appended so far), and the item texts to append (see ``_ListCodecs``)."""
        codecs = self._list_codecs(session)
        if base is None:
            codecs.positions, codecs.indexed = {}, 0
        if codecs.indexed > len(stored):
            codecs.positions, codecs.indexed = {}, 0
        for index in range(codecs.indexed, len(stored)):
            codecs.positions[stored[index]] = index
        codecs.indexed = len(stored)
        previous = codecs.encoded.get(channel, {})
        current: dict[int, tuple[Any, str]] = {}
        appended: list[str] = []
        new_positions: dict[str, int] = {}
        runs: list[list[int]] = []
        for item in values:
            hit = previous.get(id(item))
            text = hit[1] if hit is not None and hit[0] is item else self._encode(item)
            current[id(item)] = (item, text)
            position = codecs.positions.get(text)
            if position is not None and (position >= len(stored) or stored[position] != text):
                # Another incarnation of the namespace (deleted and created again elsewhere).
                codecs.positions = {t: p for p, t in enumerate(stored)}
                position = codecs.positions.get(text)
            if position is None:
                position = new_positions.get(text)
            if position is None:
                position = new_positions[text] = len(stored) + len(appended)
                appended.append(text)
            if runs and runs[-1][1] == position:
                runs[-1][1] = position + 1
            else:
                runs.append([position, position + 1])
        codecs.encoded[channel] = current
        return runs, appended

    def _decode_list(self, session: str, channel: str, texts: list[str]) -> list[Any]:
        codecs = self._list_codecs(session)
        cache = codecs.decoded.get(channel, {})
        current: dict[str, Any] = {}
        items: list[Any] = []
        for text in texts:
            item = cache.get(text, _MISSING)
            if item is _MISSING:
                item = self._decode(text)
            current[text] = item
            items.append(item)
        codecs.decoded[channel] = current
        return items

    # --- the head of a session ----------------------------------------------------------------

    def _head(self, session: str, *, fresh: bool) -> _Known | None:
        if not fresh:
            with self._known_lock:
                cached = self._known.get(session)
            if cached is not None:
                return cached
        try:
            found = self.store.get(session)
        except ExpiredError:
            found = None
        with self._known_lock:
            if found is None:
                self._known.pop(session, None)
                return None
            known = _Known(found.version, found.state)
            self._remember(session, known)
            return known

    def _remember(self, session: str, known: _Known) -> None:
        self._known[session] = known
        self._known.move_to_end(session)
        while len(self._known) > _CACHED_SESSIONS:
            self._known.popitem(last=False)

    def _forget(self, session: str) -> None:
        with self._known_lock:
            self._known.pop(session, None)
            self._codecs.pop(session, None)

    def _commit(
        self, session: str, known: _Known | None, state: ThreadState, reason: str
    ) -> _Known:
        """Write ``state`` as the version after ``known`` (compare-and-set) and cache it. A
        version holding the latest checkpoint's state becomes where readers find it."""
        version = known.version + 1 if known is not None else 1
        if state.id is not None and state.id == state.latest and state.latest_at != version:
            state = state.model_copy(update={"latest_at": version})
        if known is None:
            self.store.create(session, state, reason=reason)
        else:
            self.store.checkpoint(session, state, expected_version=known.version, reason=reason)
        committed = _Known(version, state)
        with self._known_lock:
            self._remember(session, committed)
        return committed

    def _version_of(self, session: str, known: _Known, checkpoint_id: str) -> int | None:
        """The version holding a checkpoint's newest state (it is restated when writes are
        added to it), or None when the namespace has no such checkpoint."""
        if known.state.id == checkpoint_id:
            return known.version
        if known.state.latest == checkpoint_id:
            return known.state.latest_at
        for info in self.store.history(session):
            if _parse_reason(info.reason)[0] == checkpoint_id:
                return info.version
        return None

    def _state_at(self, session: str, known: _Known, version: int) -> ThreadState:
        if version == known.version:
            return known.state
        return self.store.at(session, version).state

    def _check_mark(
        self, session: str, known: _Known | None, mark: _RunMark | None, parent: str | None = None
    ) -> _Known | None:
        """Raise ``StaleWriterError`` when a marked run is no longer current (or a put of it
        does not extend the latest checkpoint); the head it was checked against otherwise."""
        if mark is None:
            return known
        for fresh in (False, True):
            if fresh:
                known = self._head(session, fresh=True)
            latest = known.state.latest if known is not None else None
            if latest is None:
                if known is None and fresh:
                    thread, namespace = self._parse_session(session)
                    raise StaleWriterError(thread, namespace, mark.read, "(deleted)")
                continue
            assert known is not None
            current = latest == mark.read or known.state.by == mark.writer
            if current and (parent is None or parent == latest):
                return known
        thread, namespace = self._parse_session(session)
        raise StaleWriterError(thread, namespace, mark.read, str(latest))

    # --- registration in the indexes ----------------------------------------------------------

    def _add_to_index(self, index: str, name: str) -> None:
        for _ in range(_ATTEMPTS):
            found = self._index.get(index)
            try:
                if found is None:
                    self._index.create(index, _Index(names=[name]))
                    return
                if name in found.state.names:
                    return
                self._index.checkpoint(
                    index,
                    _Index(names=[*found.state.names, name]),
                    expected_version=found.version,
                    reason="index",
                )
                return
            except ConflictError:
                time.sleep(random.random() / 1000)
        raise ConflictError(index, None, None)

    def _register_namespace(self, thread_id: str, namespace: str) -> None:
        # Before the namespace's session exists: the index may name one never created (a
        # crash in between), never miss one that exists.
        self._add_to_index(self._thread_index(thread_id), namespace)

    def _register_run(self, run_id: str, session: str) -> None:
        seen = (run_id, session)
        if seen in self._runs_seen:
            return
        self._add_to_index(self._run_index(run_id), session)
        self._runs_seen[seen] = None
        while len(self._runs_seen) > 4096:
            self._runs_seen.popitem(last=False)

    def _namespaces(self, thread_id: str) -> list[str]:
        found = self._index.get(self._thread_index(thread_id))
        return [] if found is None else list(found.state.names)

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
        thread_id, namespace, parent = _ids(config)
        mark = _run_mark(config, namespace)
        session = self._session(thread_id, namespace)
        full_metadata = get_checkpoint_metadata(config, metadata)
        run_id = full_metadata.get("run_id")
        run = str(run_id) if run_id is not None else None
        reason = _reason(checkpoint["id"], run)
        with self._lock(session):
            known = self._head(session, fresh=False)
            for _ in range(_ATTEMPTS):
                known = self._check_mark(session, known, mark, parent)
                if known is None:
                    self._register_namespace(thread_id, namespace)
                try:
                    if known is not None and mark is not None:
                        known = self._drop_other_writers(session, known, mark)
                    state = self._checkpoint_state(
                        session, known, checkpoint, full_metadata, new_versions, parent, mark
                    )
                    self._commit(session, known, state, reason)
                    break
                except ConflictError as exc:
                    if isinstance(exc, StaleWriterError):
                        raise
                    known = self._head(session, fresh=True)
            else:
                raise ConflictError(session, None, None)
        if run is not None:
            self._register_run(run, session)
        return {
            "configurable": {
                "thread_id": thread_id,
                "checkpoint_ns": namespace,
                "checkpoint_id": checkpoint["id"],
            }
        }

    def _drop_other_writers(self, session: str, known: _Known, mark: _RunMark) -> _Known:
        """Before a marked run extends the latest checkpoint: that checkpoint keeps only this
        run's pending writes (and unmarked ones), restated as a new version when another run
        wrote to it too, so the loser's results are nowhere to be read."""
        writes = known.state.writes
        kept = {
            key: entry
            for key, entry in writes.items()
            if entry[_AT] != known.state.id or entry[_WRITER] in ("", mark.writer)
        }
        if len(kept) == len(writes):
            return known
        state = known.state.model_copy(update={"writes": kept})
        return self._commit(session, known, state, _reason(known.state.id, None))

    def _checkpoint_state(
        self,
        session: str,
        known: _Known | None,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
        parent: str | None,
        mark: _RunMark | None,
    ) -> ThreadState:
        previous = known.state if known is not None else None
        checkpoint_id = checkpoint["id"]
        # Unchanged channels keep their stored form only on a straight line: on another
        # branch the same version number may hold another value.
        linear = previous is not None and parent is not None and previous.id == parent
        versions = checkpoint["channel_versions"]
        items = list(previous.items) if previous is not None else []
        scalars: dict[str, str] = {}
        lists: dict[str, list[list[int]]] = {}
        for channel, value in checkpoint["channel_values"].items():
            unchanged = (
                linear
                and previous is not None
                and channel not in new_versions
                and previous.versions.get(channel) == versions.get(channel)
            )
            if type(value) is list:
                if unchanged and previous is not None and channel in previous.lists:
                    lists[channel] = previous.lists[channel]
                    continue
                runs, appended = self._encode_list(session, previous, channel, value, items)
                lists[channel] = runs
                items.extend(appended)
            elif unchanged and previous is not None and channel in previous.scalars:
                scalars[channel] = previous.scalars[channel]
            else:
                scalars[channel] = self._encode(value)
        latest = previous.latest if previous is not None else None
        writes = (
            {k: e for k, e in previous.writes.items() if e[_AT] >= checkpoint_id}
            if previous is not None
            else {}
        )
        newest = latest is None or checkpoint_id >= latest
        return ThreadState(
            id=checkpoint_id,
            parent=parent,
            v=checkpoint["v"],
            ts=checkpoint["ts"],
            versions=dict(versions),
            seen={node: dict(seen) for node, seen in checkpoint["versions_seen"].items()},
            updated=checkpoint.get("updated_channels"),
            meta=self._encode(dict(metadata)),
            by=mark.writer if mark is not None else "",
            latest=checkpoint_id if newest else latest,
            latest_at=0 if newest or previous is None else previous.latest_at,
            scalars=scalars,
            items=items,
            lists=lists,
            writes=writes,
        )

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
        thread_id, namespace, target = _ids(config)
        if target is None:
            raise UsageError("put_writes needs configurable.checkpoint_id")
        mark = _run_mark(config, namespace)
        writer = mark.writer if mark is not None else ""
        entries: dict[str, list[Any]] = {}
        for position, (channel, value) in enumerate(writes):
            index = WRITES_IDX_MAP.get(channel, position)
            key = f"{target}\x1f{task_id}\x1f{index}" + (f"\x1f{writer}" if writer else "")
            entries[key] = [target, task_id, channel, self._encode(value), task_path, index, writer]
        session = self._session(thread_id, namespace)
        with self._lock(session):
            known = self._head(session, fresh=False)
            for _ in range(_ATTEMPTS):
                known = self._check_mark(session, known, mark)
                try:
                    if known is None:
                        self._register_namespace(thread_id, namespace)
                        self._commit(
                            session,
                            None,
                            ThreadState(writes=entries),
                            _reason(None, None),
                        )
                        return
                    state = self._with_writes(session, known, target, entries)
                    if state is not None:
                        self._commit(session, known, state, _reason(state.id, None))
                    return
                except ConflictError as exc:
                    if isinstance(exc, StaleWriterError):
                        raise
                    known = self._head(session, fresh=True)
            raise ConflictError(session, None, None)

    def _with_writes(
        self, session: str, known: _Known, target: str, entries: dict[str, list[Any]]
    ) -> ThreadState | None:
        head = known.state
        latest = head.latest
        # The head's own, or newer than anything stored (its put is still on its way).
        if head.id == target or latest is None or target > latest:
            merged = _merged_writes(head.writes, entries)
            return None if merged is None else head.model_copy(update={"writes": merged})
        version = self._version_of(session, known, target)
        if version is None:
            return None  # a checkpoint no longer stored (pruned, or its run deleted)
        # Writes to an older checkpoint (a fork's first step): restate it with them.
        old = self._state_at(session, known, version)
        pending = {k: e for k, e in head.writes.items() if e[_AT] > latest}
        merged = _merged_writes({**_writes_of(old.writes, target), **pending}, entries)
        if merged is None:
            return None
        return old.model_copy(
            update={
                "writes": merged,
                "latest": latest,
                "latest_at": head.latest_at,
                "items": head.items,
            }
        )

    # --- reading ------------------------------------------------------------------------------

    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        """The config's checkpoint (the latest when it names none), with its pending writes."""
        thread_id, namespace, checkpoint_id = _ids(config)
        session = self._session(thread_id, namespace)
        with self._lock(session):
            known = self._head(session, fresh=True)
            if known is None or known.state.latest is None:
                return None
            target = checkpoint_id or known.state.latest
            version = self._version_of(session, known, target)
            if version is None:
                return None
            try:
                state = self._state_at(session, known, version)
            except StateError:
                return None  # removed by a concurrent prune
            mark = _RunMark(namespace, uuid.uuid4().hex, target) if checkpoint_id is None else None
            return self._tuple(thread_id, namespace, state, session, mark)

    def _tuple(
        self,
        thread_id: str,
        namespace: str,
        state: ThreadState,
        session: str | None,
        mark: _RunMark | None,
    ) -> CheckpointTuple:
        """The tuple of a stored state; ``session`` given, its list channels are decoded
        through the session's cache (reads of the head, once per run)."""
        values: dict[str, Any] = {
            channel: self._decode(text) for channel, text in state.scalars.items()
        }
        for channel, runs in state.lists.items():
            texts = [text for start, end in runs for text in state.items[start:end]]
            if session is None:
                values[channel] = [self._decode(text) for text in texts]
            else:
                values[channel] = self._decode_list(session, channel, texts)
        assert state.id is not None
        configurable: dict[str, Any] = {
            "thread_id": thread_id,
            "checkpoint_ns": namespace,
            "checkpoint_id": state.id,
        }
        if mark is not None:
            configurable[_RUN_MARK] = [mark.namespace, mark.writer, mark.read]
        return CheckpointTuple(
            config={"configurable": configurable},
            checkpoint={
                "v": state.v,
                "id": state.id,
                "ts": state.ts,
                "channel_values": values,
                "channel_versions": dict(state.versions),
                "versions_seen": {node: dict(seen) for node, seen in state.seen.items()},
                "updated_channels": state.updated,
            },
            metadata=cast(CheckpointMetadata, self._decode(state.meta)),
            parent_config=(
                {
                    "configurable": {
                        "thread_id": thread_id,
                        "checkpoint_ns": namespace,
                        "checkpoint_id": state.parent,
                    }
                }
                if state.parent
                else None
            ),
            pending_writes=self._pending_writes(state),
        )

    def _pending_writes(self, state: ThreadState) -> list[tuple[str, str, Any]]:
        """The checkpoint's writes in ``writes_sort_key`` order; a task's write stored by two
        runs at once counts once (the first stored)."""
        chosen: dict[tuple[str, int], list[Any]] = {}
        for entry in _writes_of(state.writes, state.id).values():
            chosen.setdefault((entry[_TASK], entry[_INDEX]), entry)
        ordered = sorted(
            chosen.values(), key=lambda e: writes_sort_key(e[_PATH], e[_TASK], e[_INDEX])
        )
        return [(e[_TASK], e[_CHANNEL], self._decode(e[_VALUE])) for e in ordered]

    def _sessions_of(self, config: RunnableConfig | None) -> list[str]:
        if config is None or "thread_id" not in (config.get("configurable") or {}):
            prefix = self._prefix()
            return [s for s in self.store.sessions() if s.startswith(prefix)]
        configurable = config["configurable"]
        thread_id = str(configurable["thread_id"])
        if "checkpoint_ns" in configurable:
            return [self._session(thread_id, str(configurable["checkpoint_ns"] or ""))]
        return [self._session(thread_id, namespace) for namespace in self._namespaces(thread_id)]

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
        for session in self._sessions_of(config):
            try:
                infos = self.store.history(session)
            except ExpiredError:
                continue
            seen: set[str] = set()
            for info in infos:
                checkpoint_id = _parse_reason(info.reason)[0]
                if checkpoint_id is None or checkpoint_id in seen:
                    continue
                seen.add(checkpoint_id)
                if before_id is None or checkpoint_id < before_id:
                    candidates.append((checkpoint_id, session, info.version))
        candidates.sort(reverse=True)
        returned = 0
        for _checkpoint_id, session, version in candidates:
            if limit is not None and returned >= limit:
                return
            try:
                state = self.store.at(session, version).state
            except (StateError, ExpiredError):
                continue  # pruned since the listing
            if filter:
                metadata = self._decode(state.meta)
                if any(metadata.get(key) != value for key, value in filter.items()):
                    continue
            thread_id, namespace = self._parse_session(session)
            yield self._tuple(thread_id, namespace, state, None, None)
            returned += 1

    # --- deleting, copying, pruning -----------------------------------------------------------

    def delete_thread(self, thread_id: str) -> None:
        """Delete every checkpoint and write of a thread, in every namespace."""
        for namespace in self._namespaces(thread_id):
            session = self._session(thread_id, namespace)
            with self._lock(session):
                self.store.delete(session)
                self._forget(session)
        self._index.delete(self._thread_index(thread_id))

    def delete_for_runs(self, run_ids: Sequence[str]) -> None:
        """Delete the checkpoints (and their writes) the given runs stored, in every thread; a
        namespace whose latest checkpoint goes falls back to its newest remaining one."""
        doomed_runs = {str(run_id) for run_id in run_ids}
        for run_id in doomed_runs:
            index = self._run_index(run_id)
            found = self._index.get(index)
            if found is None:
                continue
            for session in found.state.names:
                with self._lock(session):
                    self._drop_runs(session, doomed_runs)
            self._index.delete(index)
            self._runs_seen = OrderedDict(
                (seen, None) for seen in self._runs_seen if seen[0] != run_id
            )

    def _drop_runs(self, session: str, runs: set[str]) -> None:
        try:
            infos = self.store.history(session)
        except ExpiredError:
            return
        doomed_ids = {
            checkpoint_id
            for checkpoint_id, run in map(_parse_reason, (i.reason for i in infos))
            if checkpoint_id is not None and run in runs
        }
        if not doomed_ids:
            return
        survivors: dict[str, int] = {}
        for info in infos:  # newest first: the first version of an id is its newest state
            checkpoint_id = _parse_reason(info.reason)[0]
            if checkpoint_id is not None and checkpoint_id not in doomed_ids:
                survivors.setdefault(checkpoint_id, info.version)
        if not survivors:
            self.store.delete(session)
            self._forget(session)
            return
        known = self._head(session, fresh=True)
        if known is None:
            return
        if known.state.id in doomed_ids or known.state.latest in doomed_ids:
            latest = max(survivors)
            state = self.store.at(session, survivors[latest]).state.model_copy(
                update={"latest": latest, "items": known.state.items}
            )
            known = self._commit(session, known, state, _reason(latest, None))
        doomed_versions = [
            info.version
            for info in infos
            if _parse_reason(info.reason)[0] in doomed_ids or _parse_reason(info.reason)[0] is None
        ]
        self.store.drop_versions(session, doomed_versions)

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Copy every checkpoint and write of a thread, in every namespace, to a new thread.

        Raises:
            UsageError: the target thread already has checkpoints.
        """
        namespaces = self._namespaces(source_thread_id)
        for namespace in namespaces:
            if self.store.get(self._session(target_thread_id, namespace)) is not None:
                raise UsageError(f"thread {target_thread_id!r} already has checkpoints")
        for namespace in namespaces:
            source = self._session(source_thread_id, namespace)
            try:
                infos = list(reversed(self.store.history(source)))
            except ExpiredError:
                continue
            if not infos:
                continue
            target = self._session(target_thread_id, namespace)
            self._register_namespace(target_thread_id, namespace)
            known: _Known | None = None
            runs: set[str] = set()
            renumbered: dict[int, int] = {}  # the source's versions have gaps once pruned
            with self._lock(target):
                for info in infos:
                    state = self.store.at(source, info.version).state
                    state = state.model_copy(
                        update={"latest_at": renumbered.get(state.latest_at, 0)}
                    )
                    known = self._commit(target, known, state, info.reason)
                    renumbered[info.version] = known.version
                    run = _parse_reason(info.reason)[1]
                    if run is not None:
                        runs.add(run)
            for run in runs:
                self._register_run(run, target)

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
            for namespace in self._namespaces(thread_id):
                session = self._session(thread_id, namespace)
                with self._lock(session):
                    self._keep_latest(session)

    def _keep_latest(self, session: str) -> None:
        known = self._head(session, fresh=True)
        if known is None or known.state.latest is None:
            return
        latest = known.state.latest
        if known.state.id != latest:
            # The head is an older checkpoint restated with writes: the latest becomes head.
            old = self._state_at(session, known, known.state.latest_at)
            pending = {k: e for k, e in known.state.writes.items() if e[_AT] > latest}
            state = old.model_copy(
                update={
                    "writes": {**_writes_of(old.writes, latest), **pending},
                    "items": known.state.items,
                }
            )
            known = self._commit(session, known, state, _reason(latest, None))
        older = [
            info.version for info in self.store.history(session) if info.version != known.version
        ]
        self.store.drop_versions(session, older)

    def vacuum(self) -> VacuumReport:
        """Delete expired namespaces (``ttl``) and the index entries of what is gone."""
        report = self.store.vacuum()
        with self._known_lock:
            self._known.clear()
        return report

    # --- async twins --------------------------------------------------------------------------

    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        return await asyncio.to_thread(self.get_tuple, config)

    async def alist(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> AsyncIterator[CheckpointTuple]:
        found = await asyncio.to_thread(
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
        return await asyncio.to_thread(self.put, config, checkpoint, metadata, new_versions)

    async def aput_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        await asyncio.to_thread(self.put_writes, config, writes, task_id, task_path)

    async def adelete_thread(self, thread_id: str) -> None:
        await asyncio.to_thread(self.delete_thread, thread_id)

    async def adelete_for_runs(self, run_ids: Sequence[str]) -> None:
        await asyncio.to_thread(self.delete_for_runs, run_ids)

    async def acopy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        await asyncio.to_thread(self.copy_thread, source_thread_id, target_thread_id)

    async def aprune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        await asyncio.to_thread(self.prune, thread_ids, strategy=strategy)

    def close(self) -> None:
        """Release the backend's connections."""
        self.store.close()

    def __enter__(self) -> KeelCheckpointSaver:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
