"""How a thread's values are stored: masked, serialized with LangGraph's serde, list channels
as runs into an append-only pool of item texts, and references to those items standing in for the
very same objects elsewhere (a ``Send`` that carries the whole state)."""

from __future__ import annotations

import base64
import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from langchain_core.messages import ToolMessage
from langgraph.checkpoint.base import (
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
    writes_sort_key,
)
from langgraph.checkpoint.serde.base import SerializerProtocol
from langgraph.types import Send
from pydantic import BaseModel

from keel.errors import StateError
from keel.integrations.langgraph._thread import (
    AT,
    CACHED_SESSIONS,
    CHANNEL,
    INDEX,
    PATH,
    RUN_MARK,
    TASK,
    VALUE,
    Recent,
    RunMark,
    ThreadState,
)
from keel.privacy import PIIMasker, PrivacyView, privacy_view

__all__ = ["ThreadCodec"]

_KEPT_TEXT = frozenset({"id", "tool_call_id", "name", "type", "role", "run_id"})
"""Fields whose text is an identifier, never masked (a masked id would break pairing)."""
_MISSING = object()
_REF = "__keel_item__"
"""A stored value's stand-in for an object stored as a list channel item: ``{_REF: position}``
(a position in ``items``)."""
_RUNS = "__keel_items__"
"""A stand-in for a list holding such objects: ``{_RUNS: [segment, ...]}``, a segment either a
run ``[start, end]`` of them or ``{"v": value}`` for an item stored in place."""
_PLAIN = (str, int, float, bool, bytes, type(None))


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


def _returned_by_a_tool(value: Any) -> bool:
    """Whether ``value`` is a tool's message (a ``ToolMessage``, or one as a dict)."""
    if isinstance(value, ToolMessage):
        return True
    return type(value) is dict and (value.get("role") == "tool" or value.get("type") == "tool")


def _internal(channel: str) -> bool:
    """LangGraph's own channels (``__pregel_tasks``, ``__start__``)."""
    return channel.startswith("__")


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


class ThreadCodec:
    """Encodes and decodes one tenant's thread values, and keeps each session's list channels
    as last encoded or read (the newest ``CACHED_SESSIONS`` sessions).

    Args:
        serde: LangGraph's serializer for channel values.
        masker: masks PII before anything is stored.
        tenant: the tenant the masker masks for.
        lens: the user a call is for (`view`): masking with their numbering, reads
            revealing their values; none: masking alone.
        sessions: the list channels' cache (shared by a codec's views).
    """

    def __init__(
        self,
        serde: SerializerProtocol,
        masker: PIIMasker,
        tenant: str,
        *,
        lens: PrivacyView | None = None,
        sessions: Recent[tuple[str, Any], _ListCodecs] | None = None,
    ) -> None:
        self.serde = serde
        self.masker = masker
        self.tenant = tenant
        self.lens = lens or privacy_view(masker, tenant)
        self._sessions: Recent[tuple[str, Any], _ListCodecs] = (
            Recent(CACHED_SESSIONS) if sessions is None else sessions
        )
        # Whose list channels a session's cache holds: with a vault, a read gives the user's
        # own values, so each user has a cache of their own, good while their data key stays.
        self._viewer: Any = (self.lens.user_id, self.lens.stamp()) if self.lens.reveals else None

    @property
    def owner(self) -> str:
        """Who owns a namespace this codec creates: the user, with a vault."""
        return self.lens.user_id or "" if self.lens.reveals else ""

    def view(self, lens: PrivacyView) -> ThreadCodec:
        """This codec as one user's call sees it (masking with their numbering, reads
        revealing their values), sharing the caches of this one."""
        return ThreadCodec(self.serde, self.masker, self.tenant, lens=lens, sessions=self._sessions)

    def settle(self, session: str) -> None:
        """After a write: the session's cache is kept under the user's data key as it now is
        (the write may have created it), so it is never read under another one (after a
        ``forget``)."""
        if not self.lens.reveals:
            return
        viewer = (self.lens.user_id, self.lens.stamp())
        if viewer != self._viewer:
            found = self._sessions.get((session, self._viewer))
            self._sessions.pop((session, self._viewer))
            if found is not None:
                self._sessions.put((session, viewer), found)
            self._viewer = viewer

    def masked(self, value: Any, key: str | None = None) -> Any:
        """``value`` with its text masked, what a tool returned in it defanged first
        ([`mask_tool_output`][keel.privacy.PrivacyView.mask_tool_output]); the very same object when
        nothing needed masking."""
        return self._mapped(value, self.lens.mask, key, returned=self.lens.mask_tool_output)

    def revealed(self, value: Any) -> Any:
        """``value`` with the user's own placeholders revealed (a vault in use); the very same
        object when there was nothing to reveal."""
        return self._mapped(value, self.lens.reveal) if self.lens.reveals else value

    def _mapped(
        self,
        value: Any,
        change: Callable[[str], str],
        key: str | None = None,
        *,
        returned: Callable[[str], str] | None = None,
    ) -> Any:
        """``value`` with ``change`` applied to its text (ids kept), ``returned`` instead to
        the text of a tool's message (default: ``change``)."""
        if returned is not None and _returned_by_a_tool(value):
            change, returned = returned, None
        if isinstance(value, str):
            return value if key in _KEPT_TEXT else change(value)
        if isinstance(value, BaseModel):
            changes = {}
            for name in type(value).model_fields:
                current = getattr(value, name, None)
                mapped = self._mapped(current, change, name, returned=returned)
                if mapped is not current:
                    changes[name] = mapped
            return value.model_copy(update=changes) if changes else value
        if type(value) is dict:
            entries = {
                k: self._mapped(v, change, k if isinstance(k, str) else None, returned=returned)
                for k, v in value.items()
            }
            return entries if any(entries[k] is not v for k, v in value.items()) else value
        if type(value) is list or type(value) is tuple:
            items = [self._mapped(item, change, key, returned=returned) for item in value]
            if all(new is old for new, old in zip(items, value, strict=True)):
                return value
            return items if type(value) is list else tuple(items)
        if isinstance(value, Send):
            arg = self._mapped(value.arg, change, returned=returned)
            return value if arg is value.arg else Send(value.node, arg, timeout=value.timeout)
        return value

    def encode(self, value: Any, refs: _Refs | None = None) -> str:
        """A value's stored text: masked, with references standing in for the graph's list
        items it holds."""
        return self.encode_shown(value, refs, shown=False)[0]

    def encode_shown(
        self, value: Any, refs: _Refs | None = None, *, shown: bool = True
    ) -> tuple[str, Any]:
        """``_encode``, and what reading the text back gives (the value masked; with
        ``shown=False`` it may still hold reference stand-ins)."""
        referring = value
        if refs is not None and refs.lists:
            referring = self._with_refs(value, refs)
        masked = self.masked(referring)
        kind, data = self.serde.dumps_typed(masked)
        text = f"{kind}:{base64.b64encode(data).decode('ascii')}"
        if not shown:
            return text, masked
        if referring is not value and refs is not None:
            return text, self.decode(text, refs.shown_at)
        shown_value = self.revealed(masked)
        if shown_value is not value and self.lens.reveals and shown_value == value:
            # The user's own values come back whole: the graph goes on with its own object (a
            # read of the thread stays as cheap as what is new in it).
            return text, value
        return text, shown_value

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

    def decode(self, text: str, item_at: Callable[[int], Any] | None = None) -> Any:
        kind, _, data = text.partition(":")
        value = self.revealed(self.serde.loads_typed((kind, base64.b64decode(data))))
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

    def refs(self, session: str, pool: Sequence[str]) -> _Refs:
        """The graph's list items (stored in ``pool``): what other values refer to."""
        lists = self.list_codecs(session).lists
        return _Refs([found for name, found in lists.items() if not _internal(name)], pool)

    def list_codecs(self, session: str) -> _ListCodecs:
        """The session's list channels as last encoded or read."""
        return self._sessions.get_or_put((session, self._viewer), _ListCodecs)

    def encode_list(
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
        codecs = self.list_codecs(session)
        if base is None:
            codecs.lists = {}
        last = codecs.lists.get(channel)
        refs = self.refs(session, items)
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
                text, masked = self.encode_shown(item, refs, shown=not _internal(channel))
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

    def checkpoint_state(
        self,
        session: str,
        previous: ThreadState | None,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
        parent: str | None,
        mark: RunMark | None,
    ) -> ThreadState:
        """What a put of ``checkpoint`` stores on top of ``previous`` (the session's head)."""
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
                runs, appended = self.encode_list(session, previous, channel, value, pool, items)
                lists[channel] = runs
                pool.extend(appended)
            elif unchanged and previous is not None and channel in previous.scalars:
                scalars[channel] = previous.scalars[channel]
            else:
                scalars[channel] = self.encode(value, self.refs(session, items))
        latest = previous.latest if previous is not None else None
        # Kept: writes of this checkpoint and newer ones (saves still on their way), and the
        # parent's stored after the parent stopped being the head (a fork's first step).
        writes = (
            {
                k: e
                for k, e in previous.writes.items()
                if e[AT] >= checkpoint_id or (e[AT] == parent and previous.id != parent)
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
            meta=self.encode(dict(metadata)),
            by=mark.writer if mark is not None else "",
            owner=previous.owner if previous is not None else self.owner,
            latest=checkpoint_id if newest else latest,
            latest_at=0 if newest or previous is None else previous.latest_at,
            scalars=scalars,
            items=items,
            packets=packets,
            lists=lists,
            writes=writes,
        )

    def tuple_of(
        self,
        thread_id: str,
        namespace: str,
        state: ThreadState,
        writes: dict[str, list[Any]],
        items: list[str],
        session: str | None,
        mark: RunMark | None,
    ) -> CheckpointTuple:
        """The tuple of a stored state; references resolve into ``items`` (the head's: the
        writes gathered from later versions may refer to items stored after this state).
        ``session`` given, its list channels are decoded through the session's cache (reads
        of the head, once per run)."""
        codecs = self.list_codecs(session) if session is not None else _ListCodecs()
        decoded: dict[str, Any] = {}
        item_at = self._item_reader(items, codecs.decoded, decoded)
        values, encoded = self._read_lists(state, items, codecs, item_at)
        for channel, text in state.scalars.items():
            values[channel] = self.decode(text, item_at)
        if session is not None:
            codecs.decoded, codecs.lists = decoded, encoded
        assert state.id is not None
        configurable: dict[str, Any] = {
            "thread_id": thread_id,
            "checkpoint_ns": namespace,
            "checkpoint_id": state.id,
        }
        if mark is not None:
            configurable[RUN_MARK] = [mark.namespace, mark.writer, mark.read]
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
            metadata=cast(CheckpointMetadata, self.decode(state.meta)),
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

    def _item_reader(
        self, items: list[str], known_texts: dict[str, Any], decoded: dict[str, Any]
    ) -> Callable[[int], Any]:
        """Reads the item at a position of ``items``, each text decoded once (``decoded``
        gathers them; ``known_texts`` are those an earlier read decoded)."""

        def item_at(position: int) -> Any:
            text = items[position]
            found = decoded.get(text, _MISSING)
            if found is _MISSING:
                found = known_texts.get(text, _MISSING)
                if found is _MISSING:
                    found = self.decode(text, item_at)
                decoded[text] = found
            return found

        return item_at

    def _read_lists(
        self,
        state: ThreadState,
        items: list[str],
        codecs: _ListCodecs,
        item_at: Callable[[int], Any],
    ) -> tuple[dict[str, Any], dict[str, _Encoded]]:
        """The list channels' values, and each one as the run goes on with it."""
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
                values[channel] = [self.decode(pool[p], item_at) for p in positions]
            else:
                pool = items
                values[channel] = [item_at(p) for p in positions]
            # The run goes on with these objects: its puts find their texts by identity (a
            # decoded item need not encode back to the very same text).
            encoded[channel] = _encoded(values[channel], positions, [pool[p] for p in positions])
        return values, encoded

    def _pending_writes(
        self, writes: dict[str, list[Any]], item_at: Callable[[int], Any]
    ) -> list[tuple[str, str, Any]]:
        """A checkpoint's writes in ``writes_sort_key`` order; a task's write stored by two
        runs at once counts once (the first stored)."""
        chosen: dict[tuple[str, int], list[Any]] = {}
        for entry in writes.values():
            chosen.setdefault((entry[TASK], entry[INDEX]), entry)
        ordered = sorted(chosen.values(), key=lambda e: writes_sort_key(e[PATH], e[TASK], e[INDEX]))
        return [(e[TASK], e[CHANNEL], self.decode(e[VALUE], item_at)) for e in ordered]

    def forget(self, session: str) -> None:
        """Forget a session's list channels (every user's)."""
        self._sessions.drop(lambda key: key[0] == session)

    def clear(self) -> None:
        """Forget every session's list channels."""
        self._sessions.clear()
