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
an older checkpoint is a new branch, not a conflict, whatever config named it (one from
``get_state_history``, or from a ``get_state`` snapshot taken before the thread moved on: a
read of a named checkpoint clears the mark such a config carries). Only a run that read "the
latest" is fenced. A thread's very first checkpoint has no run mark to check against.
"""

from __future__ import annotations

import asyncio
import base64
import json
import operator
import random
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
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
from langgraph.types import Send
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
_REF = "__keel_item__"
"""A stored value's stand-in for an object stored as a list channel item: ``{_REF: position}``
(a position in ``items``)."""
_RUNS = "__keel_items__"
"""A stand-in for a list holding such objects: ``{_RUNS: [segment, ...]}``, a segment either a
run ``[start, end]`` of them or ``{"v": value}`` for an item stored in place."""
_PLAIN = (str, int, float, bool, bytes, type(None))
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
    """What one version of a thread namespace stores: one checkpoint (the head: the latest,
    or the newest left by ``delete_for_runs``), its pending writes and those of checkpoints
    written to after they stopped being the head, and where the latest is.

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
    packets: list[str] = Field(default_factory=list)
    """The items of LangGraph's own list channels (``__pregel_tasks``), kept apart so the
    graph's lists stay one run each."""
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
class _Encoded:
    """One list channel as last encoded or read: its item objects, and each one's position and
    text in its pool (``items`` or ``packets``)."""

    values: list[Any]
    """The objects the graph holds (as it passed them to a put, or as a read returned them)."""
    shown: list[Any]
    """The objects a read returns: ``values`` as stored, masked."""
    positions: list[int]
    texts: list[str]
    runs: list[list[int]]
    by_id: dict[int, int]
    """An item object's id to its index in ``values``."""

    def holds(self, index: int, pool: Sequence[str]) -> bool:
        """Whether the pool still holds item ``index`` where this says (a pool of another
        incarnation of the namespace, or of a write that lost, may not)."""
        position = self.positions[index]
        if position >= len(pool):
            return False
        text = pool[position]
        return text is self.texts[index] or text == self.texts[index]

    def runs_prefix_of(self, runs: list[list[int]], pool: Sequence[str]) -> bool:
        """Whether the stored list ``runs`` describes starts with this list's items."""
        mine = self.runs
        if not mine or len(mine) > len(runs) or mine[:-1] != runs[: len(mine) - 1]:
            return False
        last, theirs = mine[-1], runs[len(mine) - 1]
        return (
            last[0] == theirs[0]
            and last[1] <= theirs[1]
            and (last[1] == theirs[1] or len(mine) == len(runs))
            and self.holds(0, pool)
            and self.holds(len(self.values) - 1, pool)
        )

    def extended(
        self,
        values: list[Any],
        positions: list[int],
        texts: list[str],
        shown: list[Any] | None = None,
    ) -> _Encoded:
        """This list with items appended (the new object shares this one's id map)."""
        runs = [list(run) for run in self.runs]
        for position in positions:
            if runs and runs[-1][1] == position:
                runs[-1][1] = position + 1
            else:
                runs.append([position, position + 1])
        by_id = self.by_id
        for index, value in enumerate(values, start=len(self.values)):
            by_id.setdefault(id(value), index)
        return _Encoded(
            [*self.values, *values],
            [*self.shown, *(values if shown is None else shown)],
            [*self.positions, *positions],
            [*self.texts, *texts],
            runs,
            by_id,
        )

    def prefix_of(self, values: Sequence[Any], pool: Sequence[str]) -> bool:
        """Whether ``values`` starts with this list's very objects, still where this says."""
        count = len(self.values)
        return (
            0 < count <= len(values)
            and all(map(operator.is_, self.values, values))
            and self.holds(0, pool)
            and self.holds(count - 1, pool)
        )


def _positions(runs: list[list[int]]) -> list[int]:
    return [position for start, end in runs for position in range(start, end)]


def _encoded(
    values: list[Any], positions: list[int], texts: list[str], shown: list[Any] | None = None
) -> _Encoded:
    by_id: dict[int, int] = {}
    for index, value in enumerate(values):
        by_id.setdefault(id(value), index)
    return _Encoded(
        list(values),
        list(values) if shown is None else shown,
        positions,
        texts,
        _runs(positions),
        by_id,
    )


@dataclass
class _ListCodecs:
    """A session's list channels as last encoded or read, and its item texts' decoded objects.

    LangGraph keeps a list's old items as the same objects from step to step, so a put
    encodes only the new items, the store sees the old texts as its own list's (and stores the
    appended tail only), and a read decodes only texts it has not seen. Any other value that
    holds those very objects (a ``Send`` to the tool node carries the whole state) stores a
    reference to them instead of a copy. An item is taken as unchanged while it is the same
    object."""

    lists: dict[str, _Encoded] = field(default_factory=dict)
    decoded: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class _Refs:
    """What a value being encoded may refer to: the graph's lists, stored in ``pool``."""

    lists: list[_Encoded]
    pool: Sequence[str]

    def shown_at(self, position: int) -> Any:
        """The object a read gives for the item at ``position`` of the pool."""
        for encoded in self.lists:
            if position in encoded.positions:
                return encoded.shown[encoded.positions.index(position)]
        raise StateError(f"no list item is stored at {position}")

    def find(self, value: Any) -> int | None:
        for encoded in self.lists:
            index = encoded.by_id.get(id(value))
            if index is not None and encoded.values[index] is value:
                return encoded.positions[index] if encoded.holds(index, self.pool) else None
        return None


def _internal(channel: str) -> bool:
    """LangGraph's own channels (``__pregel_tasks``, ``__start__``)."""
    return channel.startswith("__")


class _Index(BaseModel):
    """A thread's namespaces, or the namespaces a run wrote to."""

    names: list[str] = Field(default_factory=list)


@dataclass(frozen=True)
class _Row:
    """What a version's reason says: the checkpoint its state is, its parent, and the run that
    stored it (None for a version that only added writes)."""

    version: int
    checkpoint_id: str | None
    parent: str | None
    run_id: str | None


def _reason(state: ThreadState, run_id: str | None) -> str:
    return _REASON + json.dumps([state.id, run_id, state.parent])


def _rows(infos: Iterable[Any]) -> list[_Row]:
    """The versions of a history listing (newest first, as ``StateStore.history`` lists)."""
    rows: list[_Row] = []
    for info in infos:
        reason = str(info.reason)
        if not reason.startswith(_REASON):
            continue
        try:
            checkpoint_id, run_id, parent = json.loads(reason[len(_REASON) :])
        except (ValueError, TypeError):
            continue
        rows.append(_Row(info.version, checkpoint_id, parent, run_id))
    return rows


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


def _runs(positions: Iterable[int]) -> list[list[int]]:
    """Positions as runs ``[start, end)`` of consecutive ones."""
    runs: list[list[int]] = []
    for position in positions:
        if runs and runs[-1][1] == position:
            runs[-1][1] = position + 1
        else:
            runs.append([position, position + 1])
    return runs


def _segments(items: list[Any]) -> list[Any]:
    """A list whose items are ``{_REF: position}`` stand-ins or values, as segments."""
    segments: list[Any] = []
    for item in items:
        if type(item) is dict and len(item) == 1 and type(item.get(_REF)) is int:
            position = item[_REF]
            last = segments[-1] if segments else None
            if type(last) is list and last[1] == position:
                last[1] = position + 1
            else:
                segments.append([position, position + 1])
        else:
            segments.append({"v": item})
    return segments


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
        self._recent: OrderedDict[tuple[str, str], int] = OrderedDict()
        """(session, checkpoint id) -> the version last written with that checkpoint."""
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

    def _encode(self, value: Any, refs: _Refs | None = None) -> str:
        """A value's stored text: masked, with references standing in for the graph's list
        items it holds."""
        return self._encode_shown(value, refs, shown=False)[0]

    def _encode_shown(
        self, value: Any, refs: _Refs | None = None, *, shown: bool = True
    ) -> tuple[str, Any]:
        """``_encode``, and what reading the text back gives (the value masked; with
        ``shown=False`` it may still hold reference stand-ins)."""
        referring = value
        if refs is not None and refs.lists:
            referring = self._with_refs(value, refs)
        masked = self._masked(referring)
        kind, data = self.serde.dumps_typed(masked)
        text = f"{kind}:{base64.b64encode(data).decode('ascii')}"
        if shown and referring is not value and refs is not None:
            masked = self._decode(text, refs.shown_at)
        return text, masked

    def _with_refs(self, value: Any, refs: _Refs) -> Any:
        if isinstance(value, _PLAIN):
            return value
        position = refs.find(value)
        if position is not None:
            return {_REF: position}
        if type(value) is dict:
            entries = {k: self._with_refs(v, refs) for k, v in value.items()}
            return entries if any(entries[k] is not v for k, v in value.items()) else value
        if type(value) is list:
            for encoded in refs.lists:
                if encoded.prefix_of(value, refs.pool):
                    # The graph's list itself (or it and more): its runs, then the rest.
                    rest = [self._with_refs(item, refs) for item in value[len(encoded.values) :]]
                    return {_RUNS: [*map(list, encoded.runs), *_segments(rest)]}
            items = [self._with_refs(item, refs) for item in value]
            if all(new is old for new, old in zip(items, value, strict=True)):
                return value
            return {_RUNS: _segments(items)}
        if type(value) is tuple:
            items = [self._with_refs(item, refs) for item in value]
            if all(new is old for new, old in zip(items, value, strict=True)):
                return value
            return tuple(items)
        if isinstance(value, Send):
            arg = self._with_refs(value.arg, refs)
            return value if arg is value.arg else Send(value.node, arg, timeout=value.timeout)
        return value

    def _decode(self, text: str, item_at: Callable[[int], Any] | None = None) -> Any:
        kind, _, data = text.partition(":")
        value = self.serde.loads_typed((kind, base64.b64decode(data)))
        return value if item_at is None else self._resolve(value, item_at)

    def _resolve(self, value: Any, item_at: Callable[[int], Any]) -> Any:
        if isinstance(value, _PLAIN):
            return value
        if type(value) is dict:
            if len(value) == 1 and type(value.get(_REF)) is int:
                return item_at(value[_REF])
            if len(value) == 1 and type(value.get(_RUNS)) is list:
                resolved: list[Any] = []
                for segment in value[_RUNS]:
                    if type(segment) is dict:
                        resolved.append(self._resolve(segment["v"], item_at))
                    else:
                        resolved.extend(item_at(p) for p in range(segment[0], segment[1]))
                return resolved
            return {k: self._resolve(v, item_at) for k, v in value.items()}
        if type(value) is list:
            return [self._resolve(item, item_at) for item in value]
        if type(value) is tuple:
            return tuple(self._resolve(item, item_at) for item in value)
        if isinstance(value, Send):
            return Send(value.node, self._resolve(value.arg, item_at), timeout=value.timeout)
        return value

    def _refs(self, session: str, pool: Sequence[str]) -> _Refs:
        """The graph's list items (stored in ``pool``): what other values refer to."""
        lists = self._list_codecs(session).lists
        return _Refs([found for name, found in lists.items() if not _internal(name)], pool)

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
        items: list[str],
    ) -> tuple[list[list[int]], list[str]]:
        """A list channel as runs into ``stored`` (the namespace's ``items`` or ``packets``,
        with what this put appended so far), and the item texts to append (see
        ``_ListCodecs``); references in them point into ``items``."""
        codecs = self._list_codecs(session)
        if base is None:
            codecs.lists = {}
        last = codecs.lists.get(channel)
        refs = self._refs(session, items)
        if last is not None and last.prefix_of(values, stored):
            # The same objects, then new ones: only the new ones are looked at.
            start = len(last.values)
            positions, texts = last.positions[:start], last.texts[:start]
            shown = last.shown[:start]
        else:
            start, positions, texts, shown = 0, [], [], []
        appended: list[str] = []
        for item in values[start:]:
            index = last.by_id.get(id(item)) if last is not None else None
            if (
                last is not None
                and index is not None
                and last.values[index] is item
                and last.holds(index, stored)
            ):
                position, text = last.positions[index], last.texts[index]
                masked = last.shown[index]
            else:
                # A masked item reads back masked, in this process as in any other.
                text, masked = self._encode_shown(item, refs, shown=not _internal(channel))
                position = len(stored) + len(appended)
                appended.append(text)
            positions.append(position)
            texts.append(text)
            shown.append(masked)
        if start and last is not None:
            codecs.lists[channel] = last.extended(
                list(values[start:]), positions[start:], texts[start:], shown[start:]
            )
        else:
            codecs.lists[channel] = _encoded(values, positions, texts, shown)
        return codecs.lists[channel].runs, appended

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
        self._forget_recent(session)

    def _forget_recent(self, session: str) -> None:
        with self._known_lock:
            for key in [key for key in self._recent if key[0] == session]:
                del self._recent[key]

    def _commit(
        self,
        session: str,
        known: _Known | None,
        state: ThreadState,
        run_id: str | None = None,
        reason: str | None = None,
    ) -> _Known:
        """Write ``state`` as the version after ``known`` (compare-and-set) and cache it. A
        version holding the latest checkpoint's state becomes where readers find it."""
        version = known.version + 1 if known is not None else 1
        if state.id is not None and state.id == state.latest and state.latest_at != version:
            state = state.model_copy(update={"latest_at": version})
        reason = reason or _reason(state, run_id)
        if known is None:
            self.store.create(session, state, reason=reason)
        else:
            self.store.checkpoint(session, state, expected_version=known.version, reason=reason)
        committed = _Known(version, state)
        with self._known_lock:
            self._remember(session, committed)
            if state.id is not None:
                self._recent[(session, state.id)] = version
                self._recent.move_to_end((session, state.id))
                while len(self._recent) > 4096:
                    self._recent.popitem(last=False)
        return committed

    def _version_of(self, session: str, known: _Known, checkpoint_id: str) -> int | None:
        """The newest version holding a checkpoint's state (a version that only adds writes
        restates the head), or None when the namespace has no such checkpoint."""
        if known.state.id == checkpoint_id:
            return known.version
        if known.state.latest == checkpoint_id:
            return known.state.latest_at
        recent = self._recent.get((session, checkpoint_id))
        if recent is not None and recent <= known.version:
            return recent
        for row in _rows(self.store.history(session)):
            if row.checkpoint_id == checkpoint_id:
                return row.version
        return None

    def _writes_for(
        self, session: str, known: _Known, state: ThreadState, rows: list[_Row] | None = None
    ) -> dict[str, list[Any]]:
        """A checkpoint's pending writes. Those stored once it was no longer the head (a
        task's late write after the next checkpoint's put, a fork's first writes) are in the
        versions after it: its children's newest versions and the head."""
        writes = _writes_of(state.writes, state.id)
        if state.id == known.state.id:
            return writes
        newest_child: dict[str, int] = {}
        for row in rows if rows is not None else _rows(self.store.history(session)):
            if row.parent == state.id and row.checkpoint_id is not None:
                newest_child.setdefault(row.checkpoint_id, row.version)
        later = [self._state_at(session, known, v) for v in sorted(newest_child.values())]
        for holder in [*later, known.state]:
            for key, entry in _writes_of(holder.writes, state.id).items():
                writes.setdefault(key, entry)
        return writes

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

    def _add_to_index(self, index: str, name: str, *, new: bool = False) -> None:
        """Add ``name`` to an index (``new``: the index most likely does not exist yet, as a
        run's: try to create it before reading it)."""
        if new:
            try:
                self._index.create(index, _Index(names=[name]))
                return
            except ConflictError:
                pass
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
        self._add_to_index(self._run_index(run_id), session, new=True)
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
                    self._commit(session, known, state, run)
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
        return self._commit(session, known, state)

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
        packets = list(previous.packets) if previous is not None else []
        scalars: dict[str, str] = {}
        lists: dict[str, list[list[int]]] = {}
        # LangGraph's own channels (a Send carries the state) after the graph's, so their values
        # refer to the graph's items.
        channels = sorted(checkpoint["channel_values"].items(), key=lambda c: c[0].startswith("__"))
        for channel, value in channels:
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
                pool = packets if _internal(channel) else items
                runs, appended = self._encode_list(session, previous, channel, value, pool, items)
                lists[channel] = runs
                pool.extend(appended)
            elif unchanged and previous is not None and channel in previous.scalars:
                scalars[channel] = previous.scalars[channel]
            else:
                scalars[channel] = self._encode(value, self._refs(session, items))
        latest = previous.latest if previous is not None else None
        # Kept: writes of this checkpoint and newer ones (saves still on their way), and the
        # parent's stored after the parent stopped being the head (a fork's first step).
        writes = (
            {
                k: e
                for k, e in previous.writes.items()
                if e[_AT] >= checkpoint_id or (e[_AT] == parent and previous.id != parent)
            }
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
            packets=packets,
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
        session = self._session(thread_id, namespace)
        with self._lock(session):
            known = self._head(session, fresh=False)
            for _ in range(_ATTEMPTS):
                known = self._check_mark(session, known, mark)
                refs = self._refs(session, known.state.items if known is not None else [])
                entries: dict[str, list[Any]] = {}
                for position, (channel, value) in enumerate(writes):
                    index = WRITES_IDX_MAP.get(channel, position)
                    key = f"{target}\x1f{task_id}\x1f{index}" + (f"\x1f{writer}" if writer else "")
                    text = self._encode(value, refs)
                    entries[key] = [target, task_id, channel, text, task_path, index, writer]
                try:
                    if known is None:
                        self._register_namespace(thread_id, namespace)
                        self._commit(
                            session,
                            None,
                            ThreadState(writes=entries),
                        )
                        return
                    state = self._with_writes(known, entries)
                    if state is not None:
                        self._commit(session, known, state)
                    return
                except ConflictError as exc:
                    if isinstance(exc, StaleWriterError):
                        raise
                    known = self._head(session, fresh=True)
            raise ConflictError(session, None, None)

    def _with_writes(self, known: _Known, entries: dict[str, list[Any]]) -> ThreadState | None:
        """The head with a task's writes added (of its own checkpoint, of one whose put is
        still on its way, or of an older one: a late write, or a fork's first step)."""
        merged = _merged_writes(known.state.writes, entries)
        return None if merged is None else known.state.model_copy(update={"writes": merged})

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
            writes = self._writes_for(session, known, state)
            found = self._tuple(
                thread_id, namespace, state, writes, known.state.items, session, mark
            )
            if checkpoint_id is not None:
                # A run from a named checkpoint is a fork. LangGraph merges this config over
                # the caller's, which may carry the mark of the read that produced it (a
                # ``get_state`` snapshot's config): cleared, the fork is never fenced by it.
                found.config["configurable"][_RUN_MARK] = None
            return found

    def _tuple(
        self,
        thread_id: str,
        namespace: str,
        state: ThreadState,
        writes: dict[str, list[Any]],
        items: list[str],
        session: str | None,
        mark: _RunMark | None,
    ) -> CheckpointTuple:
        """The tuple of a stored state; references resolve into ``items`` (the head's: the
        writes gathered from later versions may refer to items stored after this state).
        ``session`` given, its list channels are decoded through the session's cache (reads
        of the head, once per run)."""
        codecs = self._list_codecs(session) if session is not None else _ListCodecs()
        known_texts = codecs.decoded
        decoded: dict[str, Any] = {}

        def item_at(position: int) -> Any:
            text = items[position]
            found = decoded.get(text, _MISSING)
            if found is _MISSING:
                found = known_texts.get(text, _MISSING)
                if found is _MISSING:
                    found = self._decode(text, item_at)
                decoded[text] = found
            return found

        values: dict[str, Any] = {}
        encoded: dict[str, _Encoded] = {}
        for channel, runs in state.lists.items():
            last = codecs.lists.get(channel)
            if not _internal(channel) and last is not None and last.runs_prefix_of(runs, items):
                # The list this saver last stored or read, and maybe more: its objects again
                # (the cost of a read stays flat however long the list grows).
                start = len(last.values)
                tail = _positions(runs)[start:]
                tail_items = [item_at(p) for p in tail]
                tail_texts = [items[p] for p in tail]
                # The graph goes on with the objects this read returns.
                if all(map(operator.is_, last.values, last.shown)):
                    encoded[channel] = last.extended(tail_items, tail, tail_texts)
                else:
                    encoded[channel] = _encoded(
                        [*last.shown, *tail_items],
                        _positions(runs),
                        [*last.texts, *tail_texts],
                    )
                values[channel] = list(encoded[channel].values)
                continue
            positions = _positions(runs)
            if _internal(channel):
                pool = state.packets
                values[channel] = [self._decode(pool[p], item_at) for p in positions]
            else:
                pool = items
                values[channel] = [item_at(p) for p in positions]
            # The run goes on with these objects: its puts find their texts by identity (a
            # decoded item need not encode back to the very same text).
            encoded[channel] = _encoded(values[channel], positions, [pool[p] for p in positions])
        for channel, text in state.scalars.items():
            values[channel] = self._decode(text, item_at)
        if session is not None:
            codecs.decoded, codecs.lists = decoded, encoded
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
            pending_writes=self._pending_writes(writes, item_at),
        )

    def _pending_writes(
        self, writes: dict[str, list[Any]], item_at: Callable[[int], Any]
    ) -> list[tuple[str, str, Any]]:
        """A checkpoint's writes in ``writes_sort_key`` order; a task's write stored by two
        runs at once counts once (the first stored)."""
        chosen: dict[tuple[str, int], list[Any]] = {}
        for entry in writes.values():
            chosen.setdefault((entry[_TASK], entry[_INDEX]), entry)
        ordered = sorted(
            chosen.values(), key=lambda e: writes_sort_key(e[_PATH], e[_TASK], e[_INDEX])
        )
        return [(e[_TASK], e[_CHANNEL], self._decode(e[_VALUE], item_at)) for e in ordered]

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
        listings: dict[str, list[_Row]] = {}
        for session in self._sessions_of(config):
            try:
                rows = listings[session] = _rows(self.store.history(session))
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
        heads: dict[str, _Known | None] = {}
        for _checkpoint_id, session, version in candidates:
            if limit is not None and returned >= limit:
                return
            if session not in heads:
                heads[session] = self._head(session, fresh=True)
            known = heads[session]
            try:
                if known is None:
                    continue
                state = self._state_at(session, known, version)
            except (StateError, ExpiredError):
                continue  # pruned since the listing
            if filter:
                metadata = self._decode(state.meta)
                if any(metadata.get(key) != value for key, value in filter.items()):
                    continue
            thread_id, namespace = self._parse_session(session)
            writes = self._writes_for(session, known, state, listings[session])
            yield self._tuple(thread_id, namespace, state, writes, known.state.items, None, None)
            returned += 1

    def count_checkpoints(self, thread_id: str) -> int:
        """How many checkpoints a thread has stored, in every namespace, counted from the
        stored history (nothing is decoded)."""
        count = 0
        for namespace in self._namespaces(thread_id):
            try:
                rows = _rows(self.store.history(self._session(thread_id, namespace)))
            except ExpiredError:
                continue
            count += len({row.checkpoint_id for row in rows if row.checkpoint_id is not None})
        return count

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
            rows = _rows(self.store.history(session))
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
            self.store.delete(session)
            self._forget(session)
            return
        known = self._head(session, fresh=True)
        if known is None:
            return
        if known.state.id in doomed or known.state.latest in doomed:
            # The newest remaining checkpoint becomes the head (and the latest).
            latest = max(survivors)
            old = self.store.at(session, survivors[latest]).state
            state = old.model_copy(
                update={
                    "latest": latest,
                    "writes": self._writes_for(session, known, old, rows),
                    "items": known.state.items,
                    "packets": known.state.packets,
                }
            )
            known = self._commit(session, known, state)
        self.store.drop_versions(
            session,
            [row.version for row in rows if row.checkpoint_id in doomed or not row.checkpoint_id],
        )
        self._forget_recent(session)

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
            rows = {row.version: row for row in _rows(infos)}
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
                    known = self._commit(target, known, state, reason=info.reason)
                    renumbered[info.version] = known.version
                    row = rows.get(info.version)
                    if row is not None and row.run_id is not None:
                        runs.add(row.run_id)
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
            # The head is another checkpoint (restated by delete_for_runs): the latest
            # becomes the head, with every write it has.
            old = self._state_at(session, known, known.state.latest_at)
            pending = {k: e for k, e in known.state.writes.items() if e[_AT] > latest}
            state = old.model_copy(
                update={
                    "writes": {**self._writes_for(session, known, old), **pending},
                    "items": known.state.items,
                    "packets": known.state.packets,
                }
            )
            known = self._commit(session, known, state)
        older = [
            info.version for info in self.store.history(session) if info.version != known.version
        ]
        self.store.drop_versions(session, older)
        self._forget_recent(session)

    def vacuum(self) -> VacuumReport:
        """Delete expired sessions of the backend (this saver's namespaces after ``ttl``), then
        this tenant's index entries that name what is gone (an index left empty goes too)."""
        report = self.store.vacuum()
        with self._known_lock:
            self._known.clear()
            self._codecs.clear()
            self._recent.clear()
        sessions = set(self.store.sessions())
        tenant = quote(self.tenant, safe="")
        for index in sorted(sessions):
            if index.startswith(f"langgraph-thread/{tenant}/"):
                thread_id = unquote(index.rsplit("/", 1)[1])
                alive = [
                    n
                    for n in self._namespaces(thread_id)
                    if self._session(thread_id, n) in sessions
                ]
            elif index.startswith(f"langgraph-run/{tenant}/"):
                found = self._index.get(index)
                alive = [n for n in (found.state.names if found else []) if n in sessions]
            else:
                continue
            self._keep_in_index(index, alive)
        return report

    def _keep_in_index(self, index: str, names: Sequence[str]) -> None:
        for _ in range(_ATTEMPTS):
            found = self._index.get(index)
            if found is None:
                return
            kept = [name for name in found.state.names if name in names]
            try:
                if not kept:
                    self._index.delete(index)
                elif kept != found.state.names:
                    self._index.checkpoint(
                        index, _Index(names=kept), expected_version=found.version, reason="index"
                    )
                return
            except ConflictError:
                continue

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
