"""How a session's versions are encoded: the rows of a write (a delta against the version it
is written on, or a full snapshot once the deltas since the last one outweigh it) and the state a
chain of rows rebuilds.

``VersionCodec`` does no I/O: ``StateStore`` reads and writes rows through its backend, and keeps
the ``Base`` of each session (the version it last read or wrote) to encode the next delta at the
cost of what changed.
"""

from __future__ import annotations

import operator
import secrets
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Generic, TypeVar, cast

from pydantic import BaseModel

from keel.errors import UsageError
from keel.state._backend import Chain, StoredCheckpoint
from keel.state._checkpoint import CheckpointInfo
from keel.state._delta import (
    delta_of,
    diff,
    encode_full,
    encode_full_joined,
    encode_json,
    patch_of,
    replay,
)
from keel.state._schema import JSONState, StateSchema

__all__ = [
    "AppendPlan",
    "Base",
    "ItemTexts",
    "VersionCodec",
    "checkpoint_info",
    "immutable_lists",
    "ttl_seconds",
]

S = TypeVar("S")

_MISSING = object()

ROW_REPLAY_COST = 256
"""Bytes a delta is charged on top of its own for the row a read fetches, parses and applies,
so that a large state changed by tiny deltas still gets a snapshot every so many versions."""


@dataclass(frozen=True)
class Base:
    """A version this process has read or written, kept to encode the next delta cheaply."""

    session_id: str
    version: int
    epoch: str
    step: int
    last_full: int
    stored_schema_version: int
    data: JSONState
    values: dict[str, Any]
    state: Any
    immutable_lists: frozenset[str]
    """List fields of ``values`` whose items are all immutable: an identical item serialises
    and validates as it did, so a list that keeps them and appends is new only in its tail."""
    full_bytes: int
    """Bytes of the full snapshot at ``last_full``."""
    replay_bytes: int
    """What replaying the deltas after ``last_full`` costs a read: their bytes, plus
    ``ROW_REPLAY_COST`` each."""


@dataclass(frozen=True)
class AppendPlan:
    """A write that appends to list fields and sets others, planned on ``base``."""

    base: Base
    row: StoredCheckpoint
    partial: BaseModel
    """The new state with the list fields of ``tails`` and ``unchanged`` empty."""
    tails: dict[str, list[Any]]
    tails_json: dict[str, list[Any]]
    unchanged: frozenset[str]
    data: JSONState
    """The new state's JSON, its appended lists still the base's (``full_lists`` when the row
    is a full snapshot)."""
    full_lists: dict[str, list[Any]] | None
    immutable: frozenset[str]
    full_bytes: int
    replay_bytes: int
    full_texts: dict[str, list[str]] | None
    """With ``full_lists``: their text, as `ItemTexts` keeps it."""


class ItemTexts:
    """The JSON text of the list fields of the bases a store keeps, by list object: a
    snapshot joins these texts (`encode_full_joined`) instead of encoding the whole history
    again, so a write costs what is new since the last snapshot even when it is one.

    A list's text is kept as runs of its items (each run the inside of a JSON array, in
    order), with how many items they cover. An entry holds its list object (an id is never
    reused while it lives) and is valid for the items it covers: the lists of a base only
    ever grow, in place, by immutable items (see ``KnownVersions.remember_append``), so the
    items after those are encoded, as one run, when the next snapshot needs them, the rest
    never again. An entry goes with the base that holds its list (``KnownVersions`` drops it
    when that base is replaced, dropped or forgotten): it holds the list, so one left behind
    would keep a session's history in memory past ``known_sessions``. At most ``size`` lists
    are kept, the oldest dropped first (its next snapshot encodes the list whole, as before).
    """

    def __init__(self, size: int = 256) -> None:
        self.size = size
        self._texts: dict[int, tuple[list[Any], list[str], int]] = {}
        self._lock = threading.Lock()

    def of(self, items: list[Any]) -> list[str]:
        """The runs of ``items``' text: those kept, and the items after them encoded now."""
        with self._lock:
            entry = self._texts.get(id(items))
            runs, covered = ([], 0) if entry is None or entry[0] is not items else entry[1:]
        if covered > len(items):
            runs, covered = [], 0
        if covered < len(items):
            tail = items[covered:]
            runs = [*runs, encode_json(tail)[1:-1]]
            self.keep(items, runs, covered + len(tail))
        return runs

    def keep(self, items: list[Any], runs: list[str], covered: int) -> None:
        """Keep ``runs`` as the text of the first ``covered`` of ``items``."""
        with self._lock:
            self._texts.pop(id(items), None)
            if len(self._texts) >= self.size:
                del self._texts[next(iter(self._texts))]
            self._texts[id(items)] = (items, runs, covered)

    def drop(self, base: Base, kept: Base | None = None) -> None:
        """Forget the text of ``base``'s lists (a base the store no longer keeps), but of
        those ``kept`` (the base that replaced it) holds still: an entry holds its list, so
        one left behind would keep a dropped session's history in memory. Only the lists of
        immutable items have text (a snapshot joins no other)."""
        with self._lock:
            if not self._texts:
                return
            for name in base.immutable_lists:
                items = base.data.get(name)
                if kept is not None and kept.data.get(name) is items:
                    continue
                entry = self._texts.get(id(items))
                if entry is not None and entry[0] is items:
                    del self._texts[id(items)]

    def clear(self) -> None:
        """Forget every list's text."""
        with self._lock:
            self._texts.clear()

    def __len__(self) -> int:
        return len(self._texts)


_IMMUTABLE: dict[type, bool] = {
    str: True,
    int: True,
    float: True,
    bool: True,
    bytes: True,
    type(None): True,
}


def _immutable(kind: type) -> bool:
    """Whether values of this type cannot change in place (scalars, frozen Pydantic models),
    so an identical object is known to serialise as it did before."""
    known = _IMMUTABLE.get(kind)
    if known is None:
        known = (
            isinstance(kind, type)
            and issubclass(kind, BaseModel)
            and bool(kind.model_config.get("frozen"))
        )
        _IMMUTABLE[kind] = known
    return known


def immutable_lists(values: Mapping[str, Any]) -> frozenset[str]:
    """The list fields of ``values`` whose items are all immutable."""
    return frozenset(
        name
        for name, value in values.items()
        if isinstance(value, list) and all(map(_immutable, set(map(type, value))))
    )


def payload_bytes(payload: str) -> int:
    """Bytes of a payload in UTF-8."""
    return len(payload) if payload.isascii() else len(payload.encode())


def ttl_seconds(value: float | timedelta | None) -> float | None:
    """A time to live in seconds (None stays None).

    Raises:
        UsageError: it is not positive.
    """
    if value is None:
        return None
    total = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if total <= 0:
        raise UsageError(f"a time to live must be positive, got {total}s")
    return total


def checkpoint_info(session_id: str, row: StoredCheckpoint) -> CheckpointInfo:
    """What readers see of a stored row."""
    return CheckpointInfo(
        session_id=session_id,
        version=row.version,
        created_at=datetime.fromtimestamp(row.created_at, UTC),
        step=row.step,
        reason=row.reason,
        kind=row.kind,
        size_bytes=row.size,
        schema_version=row.schema_version,
        good=row.good,
        forked_from=row.forked_from,
    )


class VersionCodec(Generic[S]):
    """Encodes the versions of one state type: the row of each write, the state of a chain.

    Args:
        schema: the state type and its version.
        snapshot_every: the fewest versions between two full snapshots.
        clock: seconds since the epoch, the rows' ``created_at``.
    """

    def __init__(
        self, schema: StateSchema[S], snapshot_every: int, clock: Callable[[], float]
    ) -> None:
        self.schema = schema
        self.snapshot_every = snapshot_every
        self.clock = clock
        decorators = getattr(schema.state_type, "__pydantic_decorators__", None)
        # Custom serializers may make a field's JSON depend on other fields: dump whole states.
        self.fast_path = not (
            decorators is not None
            and (decorators.field_serializers or decorators.model_serializers)
        )
        self.item_texts = ItemTexts()
        """The JSON text of the items of the known bases' lists (the next snapshot's)."""

    def rebuild(self, session_id: str, chain: Chain) -> tuple[Base, S, StoredCheckpoint]:
        """The base, state and last row of a chain that starts at a full snapshot."""
        data = replay(row.payload for row in chain.rows)
        last = chain.rows[-1]
        migrated = self.schema.migrate(
            data, stored_name=last.schema_name, stored_version=last.schema_version
        )
        state = self.schema.validate(migrated)
        values = self.schema.field_values(state)
        base = Base(
            session_id=session_id,
            version=last.version,
            epoch=chain.head.epoch,
            step=last.step,
            last_full=chain.rows[0].version,
            stored_schema_version=last.schema_version,
            data=migrated,
            values=values,
            state=state,
            immutable_lists=immutable_lists(values),
            full_bytes=chain.rows[0].size,
            replay_bytes=sum(row.size + ROW_REPLAY_COST for row in chain.rows[1:]),
        )
        return base, state, last

    def validate_on(self, base: Base, state: Any) -> tuple[S, dict[str, int]]:
        """``state`` validated knowing ``base``, the version it is written on: lists that keep the
        base's items and append have only their new items validated."""
        return self.schema.validate_extending(state, self.known_lists(base))

    @staticmethod
    def known_lists(base: Base) -> dict[str, list[Any]]:
        """The base's lists of immutable items, which a new state may extend."""
        return {name: base.values[name] for name in base.immutable_lists}

    def encode(
        self, base: Base, state: S, kept: Mapping[str, int]
    ) -> tuple[JSONState, dict[str, Any], dict[str, Any] | None, frozenset[str]]:
        """The new state's JSON, its Python field values, the delta against the base when it
        falls out of the comparison for free (None: compute it from the JSON), and its list
        fields of immutable items.

        ``kept`` maps list fields already known to be the base's list plus new items (the
        validation found it) to the base's length, so they are not compared again."""
        values = self.schema.field_values(state)
        if not (self.fast_path and base.stored_schema_version == self.schema.version):
            return self.schema.to_json(state), values, None, immutable_lists(values)
        data: JSONState = {}
        sets: dict[str, Any] = {}
        extends: dict[str, Any] = {}
        patches: dict[str, Any] = {}
        immutable: set[str] = set()
        for name, value in values.items():
            old = base.values.get(name, _MISSING)
            if old is value and _immutable(type(value)):
                data[name] = base.data[name]
                continue
            start = kept.get(name)
            if (
                start is None
                and name in base.immutable_lists
                and isinstance(value, list)
                and len(value) >= len(old)
                and all(map(operator.is_, old, value))
            ):
                start = len(old)
            if start is not None:
                # The same objects plus a tail: only the tail is new (append-only growth).
                tail = value[start:]
                if all(map(_immutable, set(map(type, tail)))):
                    immutable.add(name)
                if not tail:
                    data[name] = base.data[name]
                    continue
                tail_json = self.schema.field_to_json(name, tail)
                data[name] = [*base.data[name], *tail_json]
                extends[name] = tail_json
                continue
            self._encode_changed(base, name, value, data, sets, patches, immutable)
        if set(base.data) - set(data):
            return data, values, None, frozenset(immutable)
        return data, values, delta_of(sets, extends, patches), frozenset(immutable)

    def _encode_changed(
        self,
        base: Base,
        name: str,
        value: Any,
        data: JSONState,
        sets: dict[str, Any],
        patches: dict[str, Any],
        immutable: set[str],
    ) -> None:
        """Encode a field that may differ from the base's into ``data``, recording it in
        ``sets`` (replaced) or ``patches`` (an object's changed keys) when it does, and in
        ``immutable`` when it is a list of immutable items."""
        encoded = self.schema.field_to_json(name, value)
        data[name] = encoded
        immutable.discard(name)
        if isinstance(value, list) and all(map(_immutable, set(map(type, value)))):
            immutable.add(name)
        previous = base.data.get(name, _MISSING)
        if isinstance(encoded, dict) and isinstance(previous, dict):
            patch = patch_of(previous, encoded)
            if patch:
                patches[name] = patch
        elif previous is _MISSING or encoded != previous:
            sets[name] = encoded

    @staticmethod
    def check_step(reason: str, step: int | None) -> None:
        """Raise ``UsageError`` for an empty reason or a negative step."""
        if not reason:
            raise UsageError("a checkpoint needs a reason")
        if step is not None and step < 0:
            raise UsageError(f"step must be >= 0, got {step}")

    def _snapshot_due(self, base: Base, version: int, replay_bytes: int) -> bool:
        """Whether ``version`` is stored whole: the deltas since the last snapshot (this one's
        included) cost a replay as much as it, at least ``snapshot_every`` versions after it."""
        return version - base.last_full >= self.snapshot_every and replay_bytes >= base.full_bytes

    def _row(
        self,
        base: Base,
        payload: str,
        *,
        full: bool,
        reason: str,
        step: int | None,
        good: bool | None,
    ) -> StoredCheckpoint:
        """The row of the version after ``base``."""
        return StoredCheckpoint(
            version=base.version + 1,
            created_at=self.clock(),
            step=base.step if step is None else step,
            reason=reason,
            kind="full" if full else "delta",
            payload=payload,
            schema_name=self.schema.name,
            schema_version=self.schema.version,
            good=good,
        )

    def check_append(self, append: Mapping[str, Sequence[Any]], update: Mapping[str, Any]) -> None:
        """Raise ``UsageError`` for an unknown field, a field both appended to and set, or
        items that are not a sequence."""
        for name in (*append, *update):
            if name not in self.schema.fields:
                raise UsageError(f"{self.schema.name} has no field {name!r}")
        for name, items in append.items():
            if name in update:
                raise UsageError(f"{name!r} is both appended to and set")
            if type(items) is list or type(items) is tuple:
                continue
            if isinstance(items, str | bytes | Mapping) or not isinstance(items, Sequence):
                raise UsageError(f"the items to append to {name!r} must be a sequence")

    def appended_state(
        self, base: Base, append: Mapping[str, Sequence[Any]], update: Mapping[str, Any]
    ) -> tuple[S, dict[str, int]]:
        """The whole new state of an append, validated as ``checkpoint`` validates one (the
        general path), with the lists it kept."""
        fields = dict(base.values)
        fields.update(update)
        for name, items in append.items():
            old = fields.get(name)
            if not isinstance(old, list):
                raise UsageError(f"{self.schema.name}.{name} is not a list: nothing to append to")
            fields[name] = [*old, *items]
        return self.validate_on(base, fields)

    def plan_append(
        self,
        base: Base,
        append: Mapping[str, Sequence[Any]],
        update: Mapping[str, Any],
        *,
        reason: str,
        step: int | None,
        good: bool | None,
    ) -> AppendPlan | None:
        """The row of an append and what the base becomes, at the cost of what is new; None
        when only the general path (the whole state validated and compared) is sound here."""
        self.check_step(reason, step)
        self.check_append(append, update)
        extensible = self.schema.extensible_lists & base.immutable_lists
        if (
            not (self.fast_path and base.stored_schema_version == self.schema.version)
            or not set(append) <= extensible
            or set(base.data) != set(base.values)
        ):
            return None
        unchanged = frozenset(name for name in extensible - set(append) if name not in update)
        validated = self.schema.validate_appending(base.values, append, update, unchanged)
        if validated is None:
            return None
        partial, tails = validated
        if not all(_immutable(type(item)) for items in tails.values() for item in items):
            return None
        tails_json = {name: self.schema.field_to_json(name, items) for name, items in tails.items()}
        data: JSONState = dict(base.data)
        sets: dict[str, Any] = {}
        patches: dict[str, Any] = {}
        immutable = set(base.immutable_lists)
        for name, value in self.schema.field_values(cast(S, partial)).items():
            if name in tails or name in unchanged:
                continue
            old = base.values.get(name, _MISSING)
            if old is value and _immutable(type(value)):
                continue
            self._encode_changed(base, name, value, data, sets, patches, immutable)
        extends = {name: items for name, items in tails_json.items() if items}
        payload = encode_json(delta_of(sets, extends, patches))
        replay_bytes = base.replay_bytes + payload_bytes(payload) + ROW_REPLAY_COST
        full_lists: dict[str, list[Any]] | None = None
        full_texts: dict[str, list[str]] | None = None
        full_bytes = base.full_bytes
        if self._snapshot_due(base, base.version + 1, replay_bytes):
            full_lists = {name: [*base.data[name], *items] for name, items in tails_json.items()}
            # The history's texts as the last snapshot (or the first read) left them, the
            # items since encoded now: a snapshot encodes what is new since the last one.
            texts = self.item_texts.of
            full_texts = {
                name: [*texts(base.data[name]), encode_json(items)[1:-1]]
                for name, items in tails_json.items()
            }
            lists = {name: texts(base.data[name]) for name in unchanged}
            payload = encode_full_joined({**data, **full_lists}, {**lists, **full_texts})
            full_bytes = payload_bytes(payload)
            replay_bytes = 0
        row = self._row(
            base, payload, full=full_lists is not None, reason=reason, step=step, good=good
        )
        return AppendPlan(
            base=base,
            row=row,
            partial=partial,
            tails=tails,
            tails_json=tails_json,
            unchanged=unchanged,
            data=data,
            full_lists=full_lists,
            immutable=frozenset(immutable),
            full_bytes=full_bytes,
            replay_bytes=replay_bytes,
            full_texts=full_texts,
        )

    def plan_write(
        self,
        base: Base,
        state: S,
        *,
        reason: str,
        step: int | None,
        good: bool | None = None,
        kept: Mapping[str, int] | None = None,
    ) -> tuple[StoredCheckpoint, Base]:
        """The row to append on top of ``base`` and the base it becomes once committed.

        A full snapshot is written on a schema change, or once both ``snapshot_every`` versions
        have passed since the last one and the deltas since then (with this one) cost a replay
        as much as that snapshot's bytes: snapshots then get rarer as the state grows, so the
        stored bytes stay within a small multiple of the deltas' and a read replays about one
        snapshot's worth of deltas, where a snapshot every so many versions would store the
        whole of a growing history over and over."""
        self.check_step(reason, step)
        data, values, delta, immutable = self.encode(base, state, kept or {})
        version = base.version + 1
        full = base.stored_schema_version != self.schema.version
        replay_bytes = 0
        if not full:
            if delta is None:
                delta = diff(base.data, data)
            payload = encode_json(delta)
            replay_bytes = base.replay_bytes + payload_bytes(payload) + ROW_REPLAY_COST
            full = self._snapshot_due(base, version, replay_bytes)
        if full:
            payload = encode_full(data)
            replay_bytes = 0
        row = self._row(base, payload, full=full, reason=reason, step=step, good=good)
        new_base = Base(
            session_id=base.session_id,
            version=version,
            epoch=base.epoch,
            step=row.step,
            last_full=version if full else base.last_full,
            stored_schema_version=self.schema.version,
            data=data,
            values=values,
            state=state,
            immutable_lists=immutable,
            full_bytes=payload_bytes(payload) if full else base.full_bytes,
            replay_bytes=replay_bytes,
        )
        return row, new_base

    def plan_create(
        self,
        session_id: str,
        state: S | Mapping[str, Any],
        reason: str,
        step: int,
        forked_from: str | None,
        good: bool | None = None,
    ) -> tuple[StoredCheckpoint, Base]:
        """The row of version 1 of a new session (a new epoch) and its base."""
        if not session_id:
            raise UsageError("a session id must not be empty")
        if step < 0:
            raise UsageError(f"step must be >= 0, got {step}")
        typed = self.schema.validate(state)
        data = self.schema.to_json(typed)
        values = self.schema.field_values(typed)
        payload = encode_full(data)
        row = StoredCheckpoint(
            version=1,
            created_at=self.clock(),
            step=step,
            reason=reason,
            kind="full",
            payload=payload,
            schema_name=self.schema.name,
            schema_version=self.schema.version,
            forked_from=forked_from,
            good=good,
        )
        base = Base(
            session_id=session_id,
            version=1,
            epoch=secrets.token_hex(8),
            step=step,
            last_full=1,
            stored_schema_version=self.schema.version,
            data=data,
            values=values,
            state=typed,
            immutable_lists=immutable_lists(values),
            full_bytes=payload_bytes(payload),
            replay_bytes=0,
        )
        return row, base
