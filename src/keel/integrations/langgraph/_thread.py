"""What a LangGraph thread namespace stores (``ThreadState``), how it is named in keel's state
store, and what a config, a run mark and a version's reason say."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar
from urllib.parse import quote, unquote

from langchain_core.runnables import RunnableConfig
from pydantic import BaseModel, Field

from keel.errors import ConflictError, UsageError

__all__ = [
    "AT",
    "ATTEMPTS",
    "CACHED_SESSIONS",
    "CHANNEL",
    "INDEX",
    "PATH",
    "RUN_MARK",
    "TASK",
    "VALUE",
    "WRITER",
    "Known",
    "Recent",
    "Row",
    "RunMark",
    "StaleWriterError",
    "ThreadNames",
    "ThreadState",
    "_Index",
    "checkpoint_ids",
    "merged_writes",
    "reason_of",
    "rows_of",
    "run_mark_of",
    "writes_of",
]

RUN_MARK = "__keel_run__"
"""The configurable key ``get_tuple`` of a latest checkpoint adds: ``[namespace, writer
token, id read]``. LangGraph merges the loaded config into the run's, so every put and write
of that run carries it; the ``__`` prefix keeps it out of checkpoint metadata."""

_REASON = "langgraph "
ATTEMPTS = 50
CACHED_SESSIONS = 256


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
class RunMark:
    """A run's mark: the namespace it read, its writer token, the checkpoint id it read."""

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
    owner: str = ""
    """The user whose vault numbered the placeholders stored here, set when a saver with a
    vault created the namespace ("": none, and no read reveals anything)."""
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
class Known:
    """A session's head as this saver last read or wrote it."""

    version: int
    state: ThreadState


class _Index(BaseModel):
    """A thread's namespaces, or the namespaces a run wrote to."""

    names: list[str] = Field(default_factory=list)


@dataclass(frozen=True)
class Row:
    """What a version's reason says: the checkpoint its state is, its parent, and the run that
    stored it (None for a version that only added writes)."""

    version: int
    checkpoint_id: str | None
    parent: str | None
    run_id: str | None


def reason_of(state: ThreadState, run_id: str | None) -> str:
    """The reason a version holding ``state`` is stored with (what ``rows_of`` reads back)."""
    return _REASON + json.dumps([state.id, run_id, state.parent])


def rows_of(infos: Iterable[Any]) -> list[Row]:
    """The versions of a history listing (newest first, as ``StateStore.history`` lists)."""
    rows: list[Row] = []
    for info in infos:
        reason = str(info.reason)
        if not reason.startswith(_REASON):
            continue
        try:
            checkpoint_id, run_id, parent = json.loads(reason[len(_REASON) :])
        except (ValueError, TypeError):
            continue
        rows.append(Row(info.version, checkpoint_id, parent, run_id))
    return rows


def checkpoint_ids(config: RunnableConfig) -> tuple[str, str, str | None]:
    """The thread id, namespace and checkpoint id (if any) a config names."""
    configurable = config.get("configurable") or {}
    if "thread_id" not in configurable:
        raise UsageError("a LangGraph checkpoint config needs configurable.thread_id")
    return (
        str(configurable["thread_id"]),
        str(configurable.get("checkpoint_ns") or ""),
        configurable.get("checkpoint_id"),
    )


def run_mark_of(config: RunnableConfig, namespace: str) -> RunMark | None:
    """The run mark a config carries for ``namespace``, if any."""
    raw = (config.get("configurable") or {}).get(RUN_MARK)
    if isinstance(raw, list | tuple) and len(raw) == 3 and raw[0] == namespace:
        return RunMark(str(raw[0]), str(raw[1]), str(raw[2]))
    return None  # no mark, or a parent graph's mark inherited by a subgraph


AT, TASK, CHANNEL, VALUE, PATH, INDEX, WRITER = range(7)
"""Positions in a pending-write entry."""


def writes_of(writes: dict[str, list[Any]], checkpoint_id: str | None) -> dict[str, list[Any]]:
    """The entries of ``writes`` that belong to ``checkpoint_id``."""
    return {key: entry for key, entry in writes.items() if entry[AT] == checkpoint_id}


def merged_writes(
    existing: dict[str, list[Any]], new: dict[str, list[Any]]
) -> dict[str, list[Any]] | None:
    """``existing`` with ``new`` added (a write already stored for its task and index is kept,
    except the special channels LangGraph overwrites); None when nothing changes."""
    merged = dict(existing)
    changed = False
    for key, entry in new.items():
        if key in merged and (entry[INDEX] >= 0 or merged[key] == entry):
            continue
        merged[key] = entry
        changed = True
    return merged if changed else None


@dataclass(frozen=True)
class ThreadNames:
    """The keel state sessions of one tenant's threads: a session per (thread, namespace), an
    index of each thread's namespaces and of the sessions each run wrote to."""

    tenant: str

    @property
    def prefix(self) -> str:
        """What every namespace session of this tenant starts with."""
        return f"langgraph/{quote(self.tenant, safe='')}/"

    def session(self, thread_id: str, namespace: str) -> str:
        """The session of one thread namespace."""
        return f"{self.prefix}{quote(thread_id, safe='')}/{quote(namespace, safe='')}"

    def thread_index(self, thread_id: str) -> str:
        """The session listing a thread's namespaces."""
        return f"langgraph-thread/{quote(self.tenant, safe='')}/{quote(thread_id, safe='')}"

    def run_index(self, run_id: str) -> str:
        """The session listing the namespace sessions a run wrote to."""
        return f"langgraph-run/{quote(self.tenant, safe='')}/{quote(run_id, safe='')}"

    def parse_session(self, session: str) -> tuple[str, str]:
        """The thread id and namespace of a namespace session."""
        thread, namespace = session[len(self.prefix) :].split("/")
        return unquote(thread), unquote(namespace)


K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Recent(Generic[K, V]):
    """The newest ``size`` entries of a map, the least recently put going first; safe to share
    between threads."""

    def __init__(self, size: int) -> None:
        self._items: OrderedDict[K, V] = OrderedDict()
        self._size = size
        self._lock = threading.Lock()

    def __contains__(self, key: K) -> bool:
        return key in self._items

    def get(self, key: K) -> V | None:
        """The entry of ``key``, if kept."""
        with self._lock:
            return self._items.get(key)

    def put(self, key: K, value: V) -> V:
        """Keep ``value`` as the newest entry of ``key``; returns it."""
        with self._lock:
            self._items[key] = value
            self._keep_newest(key)
        return value

    def get_or_put(self, key: K, make: Callable[[], V]) -> V:
        """The entry of ``key`` (``make()`` when none), now the newest."""
        with self._lock:
            found = self._items.get(key)
            if found is None:
                found = self._items[key] = make()
            self._keep_newest(key)
            return found

    def _keep_newest(self, key: K) -> None:
        self._items.move_to_end(key)
        while len(self._items) > self._size:
            self._items.popitem(last=False)

    def drop(self, which: Callable[[K], bool]) -> None:
        """Drop the entries whose key ``which`` selects."""
        with self._lock:
            for key in [key for key in self._items if which(key)]:
                del self._items[key]

    def pop(self, key: K) -> None:
        """Drop the entry of ``key``, if kept."""
        with self._lock:
            self._items.pop(key, None)

    def clear(self) -> None:
        """Drop every entry."""
        with self._lock:
            self._items.clear()
