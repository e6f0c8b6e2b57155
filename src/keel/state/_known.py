"""What a ``StateStore`` knows of each session: the base of the newest version it read or wrote.

A read of that version again costs one head row (nothing is decoded or validated again); a read
once another writer (another process) moved the head on costs the rows written since: they are
applied to the known version, their new list items alone validated (a catch-up), instead of the
whole chain since the last snapshot being decoded again. A write on a known version encodes only
what changed (``VersionCodec``). Several threads share one store, so the bases live behind a
lock.
"""

from __future__ import annotations

import operator
import threading
from collections import OrderedDict
from dataclasses import replace
from typing import Any, Generic, TypeVar, cast

from pydantic import BaseModel

from keel.errors import StoreError
from keel.state._backend import Chain
from keel.state._checkpoint import Checkpoint
from keel.state._codec import (
    ROW_REPLAY_COST,
    AppendPlan,
    Base,
    VersionCodec,
    checkpoint_info,
    immutable_lists,
)
from keel.state._delta import replay

__all__ = ["KNOWN_BYTES", "KNOWN_SESSIONS", "PARTIAL", "KnownVersions", "Partial", "whole"]

S = TypeVar("S")
_T = TypeVar("_T")


class Partial:
    """What a read for a known version gave when it cannot be resolved on that version (the
    store holds another one now, or the rows after it are not all there): read the whole
    chain instead."""


PARTIAL = Partial()


def whole(found: _T | Partial) -> _T:
    """A read of a whole chain's result (a chain that does not start at a snapshot is a fault
    of the backend)."""
    if isinstance(found, Partial):
        raise StoreError("the backend's chain does not start at a full snapshot")
    return found


def _state_bytes(base: Base) -> int:
    """About how many bytes of JSON ``base``'s state is: its last snapshot and the rows since."""
    return base.full_bytes + base.replay_bytes


def _copy(state: Any) -> Any:
    """A caller's own copy of the state's mutable containers."""
    if isinstance(state, BaseModel):
        containers = {
            name: type(value)(value)
            for name, value in state.__dict__.items()
            if isinstance(value, list | dict | set)
        }
        return state.model_copy(update=containers)
    return state


def _container_copy(value: Any) -> Any:
    """A field's JSON value with its top container (a list, an object) copied: a delta
    changes a field's list or object one level deep, never what lies inside."""
    if isinstance(value, list):
        return list(value)
    if isinstance(value, dict):
        return dict(value)
    return value


KNOWN_SESSIONS = 1024
KNOWN_BYTES = 64 << 20


class KnownVersions(Generic[S]):
    """The newest base of each session this store read or wrote, and reads resolved on it.

    A long-running process (a service worker) meets sessions without end: the bases kept are
    the most recently used, at most ``max_sessions`` of them and about ``max_bytes`` of their
    state's JSON (the newest base is kept whatever its size). A session whose base was dropped
    is read whole on its next turn, as by a process that never knew it."""

    def __init__(
        self,
        codec: VersionCodec[S],
        *,
        max_sessions: int = KNOWN_SESSIONS,
        max_bytes: int = KNOWN_BYTES,
    ) -> None:
        self._codec = codec
        self._bases: OrderedDict[str, Base] = OrderedDict()
        self._bytes = 0
        self.max_sessions = max_sessions
        self.max_bytes = max_bytes
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._bases)

    def get(self, session_id: str) -> Base | None:
        """The session's newest known base, if any (now the most recently used)."""
        with self._lock:
            base = self._bases.get(session_id)
            if base is not None:
                self._bases.move_to_end(session_id)
            return base

    def _keep(self, base: Base) -> None:
        """``base`` as its session's known one, the least recently used dropped past the
        bounds. Called with the lock held."""
        texts = self._codec.item_texts
        old = self._bases.pop(base.session_id, None)
        if old is not None:
            self._bytes -= _state_bytes(old)
            # The lists the new base no longer holds (a snapshot's are new objects) take
            # their text with them.
            texts.drop(old, base)
        self._bases[base.session_id] = base
        self._bytes += _state_bytes(base)
        while len(self._bases) > 1 and (
            len(self._bases) > self.max_sessions or self._bytes > self.max_bytes
        ):
            _, dropped = self._bases.popitem(last=False)
            self._bytes -= _state_bytes(dropped)
            texts.drop(dropped)

    def resolve(
        self,
        session_id: str,
        version: int | None,
        chain: Chain | None,
        cached: Base | None = None,
        *,
        copy: bool = True,
    ) -> tuple[Base, Checkpoint[S]] | Partial | None:
        """The base and checkpoint a read's ``chain`` holds; ``PARTIAL`` when it is the head row
        alone (read for ``cached``) and that is no longer what this store knows."""
        if chain is None or not chain.rows:
            return None
        last = chain.rows[-1]
        if (
            cached is not None
            and last.version == cached.version == chain.head.version
            and chain.head.epoch == cached.epoch
            and last.schema_version == cached.stored_schema_version
        ):
            # The head is the version this store last read or wrote: its state is known, so
            # nothing is decoded or validated again (the cost of a read stays flat however long
            # the session grows). The caller gets its own copy of the mutable containers, taken
            # while the base is still the newest (an append grows the newest base's lists).
            with self._lock:
                if self._bases.get(session_id) is cached:
                    state = _copy(cached.state) if copy else cached.state
                    return cached, Checkpoint(checkpoint_info(session_id, last), state)
        if chain.rows[0].kind != "full":
            # The rows after the version this store knows: applied to it, when it is still the
            # base this store holds and they are all there; else the whole chain is read.
            return PARTIAL if cached is None else self._catch_up(session_id, chain, cached)
        base, state, last = self._codec.rebuild(session_id, chain)
        if version is None or version == chain.head.version:
            self.remember(base)
        return base, Checkpoint(checkpoint_info(session_id, last), state)

    def _catch_up(
        self, session_id: str, chain: Chain, cached: Base
    ) -> tuple[Base, Checkpoint[S]] | Partial:
        """The head ``chain`` reaches by the rows after ``cached``'s version: those rows applied
        to it, at a cost that grows with them, not with the session (``PARTIAL`` when they
        cannot be: not the rows right after it, another schema, or the base was replaced)."""
        rows, schema = chain.rows, self._codec.schema
        last = rows[-1]
        if (
            chain.head.epoch != cached.epoch
            or rows[0].version != cached.version + 1
            or last.version != chain.head.version
            or len(rows) != last.version - cached.version
            or cached.stored_schema_version != schema.version
            or any(
                row.kind != "delta" or row.schema_version != schema.version
                or row.schema_name != schema.name
                for row in rows
            )
        ):  # fmt: skip
            return PARTIAL
        with self._lock:
            if self._bases.get(session_id) is not cached:
                return PARTIAL
            # Copies, taken while the base is the newest (an append grows its lists in place):
            # the deltas are applied to these, and what only grew keeps the base's objects.
            data = {name: _container_copy(value) for name, value in cached.data.items()}
            known = {name: list(cached.values[name]) for name in cached.immutable_lists}
        # The extensible lists whose leading items come out of the deltas as the very JSON
        # objects they were keep the base's validated items for them (those JSON items are
        # the ones they were validated from): only the items after them are validated.
        lengths = {
            name: len(data[name])
            for name in schema.extensible_lists & known.keys()
            if isinstance(data.get(name), list)
        }
        leading = {name: data[name][: lengths[name]] for name in lengths}
        migrated = schema.migrate(
            replay((row.payload for row in rows), data),
            stored_name=last.schema_name,
            stored_version=last.schema_version,
        )
        fields: dict[str, Any] = dict(migrated)
        for name, length in lengths.items():
            grown = migrated.get(name)
            if (
                isinstance(grown, list)
                and len(grown) >= length == len(known[name])
                and all(map(operator.is_, leading[name], grown))
            ):
                fields[name] = [*known[name], *grown[length:]]
        state, _ = schema.validate_extending(fields, known)
        values = schema.field_values(state)
        base = replace(
            cached,
            version=last.version,
            step=last.step,
            stored_schema_version=last.schema_version,
            data=migrated,
            values=values,
            state=state,
            immutable_lists=immutable_lists(values),
            replay_bytes=cached.replay_bytes + sum(row.size + ROW_REPLAY_COST for row in rows),
        )
        self.remember(base)
        return base, Checkpoint(checkpoint_info(session_id, last), state)

    def remember(self, base: Base, owned: frozenset[str] = frozenset()) -> None:
        """Keep ``base`` as the session's newest known version. ``owned`` names lists this store
        built itself and handed to no caller, which need no copy."""
        # Keep our own list objects: a caller appending to the state's list in place must not
        # change the base the next delta is computed against.
        base = replace(
            base,
            values={
                k: list(v) if isinstance(v, list) and k not in owned else v
                for k, v in base.values.items()
            },
        )
        with self._lock:
            current = self._bases.get(base.session_id)
            if current is None or current.epoch != base.epoch or current.version <= base.version:
                self._keep(base)

    def remember_append(self, plan: AppendPlan) -> int:
        """Make the committed append the session's known base; returns its version.

        The base's own lists (never handed to a caller) grow in place while it is the newest
        version this store knows, so an append costs its new items; a base another version
        replaced meanwhile has its lists copied instead."""
        base, row = plan.base, plan.row
        with self._lock:
            current = self._bases.get(base.session_id)
            in_place = current is base
            values = dict(base.values)
            data = dict(plan.data)
            joined: list[tuple[list[Any], list[str]]] = []
            for name, items in plan.tails.items():
                if in_place:
                    values[name].extend(items)
                else:
                    values[name] = [*values[name], *items]
                if plan.full_lists is not None:
                    data[name] = plan.full_lists[name]
                    if plan.full_texts is not None:
                        joined.append((data[name], plan.full_texts[name]))
                elif in_place:
                    data[name].extend(plan.tails_json[name])
                else:
                    data[name] = [*data[name], *plan.tails_json[name]]
            lists = {name: values[name] for name in (*plan.tails, *plan.unchanged)}
            state = plan.partial.model_copy(update=lists)
            for name, value in self._codec.schema.field_values(cast(S, state)).items():
                if name not in lists:
                    values[name] = list(value) if isinstance(value, list) else value
            # Built whole, not with ``dataclasses.replace`` (which walks the fields each call):
            # every checkpoint makes one.
            new_base = Base(
                session_id=base.session_id,
                version=row.version,
                epoch=base.epoch,
                step=row.step,
                last_full=row.version if plan.full_lists is not None else base.last_full,
                stored_schema_version=self._codec.schema.version,
                data=data,
                values=values,
                state=state,
                immutable_lists=plan.immutable,
                full_bytes=plan.full_bytes,
                replay_bytes=plan.replay_bytes,
            )
            if current is None or current.epoch != base.epoch or current.version < row.version:
                self._keep(new_base)
                # The snapshot's text, kept with the base that holds its lists (one not kept,
                # a reader's newer base kept meanwhile, would hold its history to no use).
                for items, runs in joined:
                    self._codec.item_texts.keep(items, runs, len(items))
        return row.version

    def forget(self, session_id: str) -> None:
        """Forget a session's base (its history was rewritten or deleted)."""
        with self._lock:
            dropped = self._bases.pop(session_id, None)
            if dropped is not None:
                self._bytes -= _state_bytes(dropped)
                self._codec.item_texts.drop(dropped)

    def clear(self) -> None:
        """Forget every session's base."""
        with self._lock:
            self._bases.clear()
            self._bytes = 0
            self._codec.item_texts.clear()
