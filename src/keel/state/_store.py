"""``StateStore``: typed, versioned, compare-and-set state with history, on any backend.

Every write names the version it read; the backend appends the next version only if the head is
still that version, else ``ConflictError`` and nothing of the write is visible. Checkpoints are
stored as deltas (appended list tails, changed fields) with a full snapshot once the deltas since
the last one outweigh it (and at least ``snapshot_every`` versions after it), so storage grows
with what changed. Sync methods have ``a``-prefixed async twins with the same logic over the
backend's async twins (native asyncio on PostgreSQL and Redis; a worker thread on SQLite).
"""

from __future__ import annotations

import asyncio
import json
import operator
import os
import secrets
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, replace
from dataclasses import replace as replace_dc
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Generic, TypeVar, cast

from pydantic import BaseModel

from keel.errors import (
    ConflictError,
    DatabaseLockedError,
    ExpiredError,
    StateError,
    StoreError,
    UsageError,
)
from keel.state._backend import Chain, StateBackend, StoredCheckpoint
from keel.state._checkpoint import (
    Checkpoint,
    CheckpointInfo,
    CheckpointReason,
    Retention,
    VacuumReport,
)
from keel.state._delta import delta_of, diff, encode_full, patch_of, replay
from keel.state._schema import JSONState, StateSchema

__all__ = ["SessionLock", "StateStore", "vacuum"]

S = TypeVar("S")
_T = TypeVar("_T")

_MISSING = object()


class _Partial:
    """What a read of the head row alone gave when it was not the head this store holds."""


_PARTIAL = _Partial()


def _whole(found: _T | _Partial) -> _T:
    if isinstance(found, _Partial):
        raise StoreError("the backend's chain does not start at a full snapshot")
    return found


_ROW_REPLAY_COST = 256
"""Bytes a delta is charged on top of its own for the row a read fetches, parses and applies,
so that a large state changed by tiny deltas still gets a snapshot every so many versions."""


@dataclass(frozen=True)
class _Base:
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
    ``_ROW_REPLAY_COST`` each."""


@dataclass(frozen=True)
class _AppendPlan:
    """A write that appends to list fields and sets others, planned on ``base``."""

    base: _Base
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


def _immutable_lists(values: Mapping[str, Any]) -> frozenset[str]:
    return frozenset(
        name
        for name, value in values.items()
        if isinstance(value, list) and all(map(_immutable, set(map(type, value))))
    )


def _payload_bytes(payload: str) -> int:
    return len(payload) if payload.isascii() else len(payload.encode())


def _seconds(value: float | timedelta | None) -> float | None:
    if value is None:
        return None
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if seconds <= 0:
        raise UsageError(f"a time to live must be positive, got {seconds}s")
    return seconds


def _info(session_id: str, row: StoredCheckpoint) -> CheckpointInfo:
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


def _process_identity() -> str:
    """This machine, PID namespace and process: enough to tell, from another process on the
    same machine, whether a lease's holder still runs."""
    try:
        namespace = Path("/proc/self/ns/pid").stat().st_ino
    except OSError:
        namespace = 0
    return f"{socket.gethostname()}:{namespace}:{os.getpid()}"


_THIS_PROCESS = _process_identity()


def _died(holder: str) -> bool:
    """Whether the owner ``holder`` is a process of this machine (and PID namespace) that no
    longer runs. Owners from elsewhere, or in any other format, are never presumed dead."""
    host, _, rest = holder.partition(":")
    namespace, _, rest = rest.partition(":")
    pid_text, _, _ = rest.partition(":")
    mine_host, mine_namespace, mine_pid = _THIS_PROCESS.split(":")
    if host != mine_host or namespace != mine_namespace or not pid_text.isdigit():
        return False
    pid = int(pid_text)
    if pid == int(mine_pid):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


class SessionLock:
    """An advisory lease on a session (``with store.lock(session_id): ...``).

    Advisory only: it keeps well-behaved writers from racing, but correctness never depends on
    it. A writer whose lease expired mid-work is still rejected by the version check (fencing).
    """

    def __init__(self, backend: StateBackend, key: str, ttl: float, clock: Callable[[], float]):
        self._backend = backend
        self.key = key
        self.ttl = ttl
        # The owner names its machine and process, so that a process on the same machine can
        # tell that a holder died (SIGKILL, power cut of a laptop app) and take over at once.
        self.owner = f"{_THIS_PROCESS}:{uuid.uuid4().hex}"
        self._clock = clock
        self.held = False

    def acquire(self, wait: float = 0.0) -> bool:
        """Try to take the lease, retrying for up to ``wait`` seconds."""
        deadline = time.monotonic() + wait
        delay = 0.005
        while True:
            if self._backend.acquire_lock(self.key, self.owner, self.ttl, self._clock()):
                self.held = True
                return True
            holder = self._backend.lock_holder(self.key, self._clock())
            if holder is not None and _died(holder):
                self._backend.release_lock(self.key, holder)
                continue
            if time.monotonic() >= deadline:
                return False
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 0.1)

    def release(self) -> bool:
        """Release the lease if this owner still holds it (False if it expired and was taken)."""
        released = self._backend.release_lock(self.key, self.owner)
        self.held = False
        return released

    async def aacquire(self, wait: float = 0.0) -> bool:
        """Async twin of ``acquire``."""
        deadline = time.monotonic() + wait
        delay = 0.005
        while True:
            if await self._backend.aacquire_lock(self.key, self.owner, self.ttl, self._clock()):
                self.held = True
                return True
            holder = await self._backend.alock_holder(self.key, self._clock())
            if holder is not None and _died(holder):
                await self._backend.arelease_lock(self.key, holder)
                continue
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 0.1)

    async def arelease(self) -> bool:
        """Async twin of ``release``."""
        released = await self._backend.arelease_lock(self.key, self.owner)
        self.held = False
        return released


class StateStore(Generic[S]):
    """Typed, versioned state of agent sessions on one backend.

    Args:
        backend: where checkpoints live (``keel.stores.open_state_backend(url)`` builds one).
        schema: the state type, or a ``StateSchema`` with its version and migrations.
        retention: how much history ``vacuum()`` keeps per session.
        snapshot_every: the fewest versions between two full snapshots (the rest are deltas).
            A snapshot is stored once this many versions have passed and the deltas since the
            last one outweigh it: a small state gets one every ``snapshot_every`` versions, a
            growing one ever more rarely, so storage stays linear in what changed while a read
            replays about one snapshot's worth of deltas. (A snapshot every so many versions
            would store a growing history over and over: quadratic in the session's length.)
        default_ttl: time to live (seconds or timedelta) of new sessions; each write extends it.
        clock: seconds since the epoch; injectable for tests of expiry and retention.
    """

    def __init__(
        self,
        backend: StateBackend,
        schema: StateSchema[S] | type[S],
        *,
        retention: Retention | None = None,
        snapshot_every: int = 100,
        default_ttl: float | timedelta | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if snapshot_every < 1:
            raise UsageError("snapshot_every must be >= 1")
        self.backend = backend
        self.schema: StateSchema[S] = (
            schema if isinstance(schema, StateSchema) else StateSchema(schema)
        )
        self.retention = retention or Retention()
        self.snapshot_every = snapshot_every
        self.default_ttl = _seconds(default_ttl)
        self.clock = clock
        self._cache: dict[str, _Base] = {}
        self._cache_lock = threading.Lock()
        state_type = self.schema.state_type
        decorators = getattr(state_type, "__pydantic_decorators__", None)
        # Custom serializers may make a field's JSON depend on other fields: dump whole states.
        self._fast_path = not (
            decorators is not None
            and (decorators.field_serializers or decorators.model_serializers)
        )

    # --- reading ------------------------------------------------------------------------------

    def _rebuild(self, session_id: str, chain: Chain) -> tuple[_Base, S, StoredCheckpoint]:
        data = replay(row.payload for row in chain.rows)
        last = chain.rows[-1]
        migrated = self.schema.migrate(
            data, stored_name=last.schema_name, stored_version=last.schema_version
        )
        state = self.schema.validate(migrated)
        values = self.schema.field_values(state)
        base = _Base(
            session_id=session_id,
            version=last.version,
            epoch=chain.head.epoch,
            step=last.step,
            last_full=chain.rows[0].version,
            stored_schema_version=last.schema_version,
            data=migrated,
            values=values,
            state=state,
            immutable_lists=_immutable_lists(values),
            full_bytes=chain.rows[0].size,
            replay_bytes=sum(row.size + _ROW_REPLAY_COST for row in chain.rows[1:]),
        )
        return base, state, last

    def _read(self, session_id: str, version: int | None) -> tuple[_Base, Checkpoint[S]] | None:
        cached = self._cache.get(session_id) if version is None else None
        if cached is not None:
            chain = self.backend.read_head_chain(
                session_id, self.clock(), cached.version, cached.epoch
            )
            found = self._finish_read(session_id, version, chain, cached)
            if not isinstance(found, _Partial):
                return found
        chain = self.backend.read_chain(session_id, version, self.clock())
        return _whole(self._finish_read(session_id, version, chain))

    async def _aread(
        self, session_id: str, version: int | None, *, copy: bool = True
    ) -> tuple[_Base, Checkpoint[S]] | None:
        cached = self._cache.get(session_id) if version is None else None
        if cached is not None:
            chain = await self.backend.aread_head_chain(
                session_id, self.clock(), cached.version, cached.epoch
            )
            found = self._finish_read(session_id, version, chain, cached, copy=copy)
            if not isinstance(found, _Partial):
                return found
        chain = await self.backend.aread_chain(session_id, version, self.clock())
        return _whole(self._finish_read(session_id, version, chain, copy=copy))

    def _finish_read(
        self,
        session_id: str,
        version: int | None,
        chain: Chain | None,
        cached: _Base | None = None,
        *,
        copy: bool = True,
    ) -> tuple[_Base, Checkpoint[S]] | _Partial | None:
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
            with self._cache_lock:
                if self._cache.get(session_id) is cached:
                    state = self._copy(cached.state) if copy else cached.state
                    return cached, Checkpoint(_info(session_id, last), state)
        if chain.rows[0].kind != "full":
            # The head row alone, for a cached base that is no longer this store's: the
            # caller reads the whole chain instead.
            return _PARTIAL
        base, state, last = self._rebuild(session_id, chain)
        if version is None or version == chain.head.version:
            self._remember(base)
        return base, Checkpoint(_info(session_id, last), state)

    def _copy(self, state: Any) -> Any:
        if isinstance(state, BaseModel):
            containers = {
                name: type(value)(value)
                for name, value in state.__dict__.items()
                if isinstance(value, list | dict | set)
            }
            return state.model_copy(update=containers)
        return state

    def get(self, session_id: str) -> Checkpoint[S] | None:
        """The latest checkpoint of a session, or None if there is none.

        Raises:
            ExpiredError: the session existed but its time to live has passed (it reads as
                absent: the state is not returned).
            StateMigrationError: stored data from another schema version with no migration.
        """
        found = self._read(session_id, None)
        return None if found is None else found[1]

    def load(self, session_id: str) -> Checkpoint[S]:
        """Like ``get`` but a missing session raises ``StateError``."""
        found = self.get(session_id)
        if found is None:
            raise StateError(f"no state stored for session {session_id!r}")
        return found

    def at(self, session_id: str, version: int) -> Checkpoint[S]:
        """The checkpoint at ``version``.

        Raises:
            StateError: that version is not stored (never written, or removed by retention).
        """
        found = self._read(session_id, version)
        if found is None or found[1].version != version:
            raise StateError(f"session {session_id!r} has no stored version {version}")
        return found[1]

    def history(self, session_id: str, limit: int | None = None) -> list[CheckpointInfo]:
        """The session's checkpoints, newest first (at most ``limit``)."""
        rows = self.backend.history(session_id, self.clock())
        infos = [_info(session_id, row) for row in reversed(rows)]
        return infos[:limit] if limit is not None else infos

    def last_good(self, session_id: str) -> CheckpointInfo | None:
        """The newest checkpoint marked good, if any."""
        for info in self.history(session_id):
            if info.good:
                return info
        return None

    def sessions(self) -> list[str]:
        """Ids of stored sessions."""
        return self.backend.sessions()

    # --- writing ------------------------------------------------------------------------------

    def _remember(self, base: _Base, owned: frozenset[str] = frozenset()) -> None:
        """Cache ``base`` as the session's latest known version. ``owned`` names lists this store
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
        with self._cache_lock:
            current = self._cache.get(base.session_id)
            if current is None or current.epoch != base.epoch or current.version <= base.version:
                self._cache[base.session_id] = base

    def _base_for(self, session_id: str, expected_version: int) -> _Base:
        cached = self._cache.get(session_id)
        if cached is not None and cached.version == expected_version:
            return cached
        return self._check_base(session_id, expected_version, self._read(session_id, None))

    async def _abase_for(self, session_id: str, expected_version: int) -> _Base:
        cached = self._cache.get(session_id)
        if cached is not None and cached.version == expected_version:
            return cached
        found = await self._aread(session_id, None)
        return self._check_base(session_id, expected_version, found)

    @staticmethod
    def _check_base(
        session_id: str, expected_version: int, found: tuple[_Base, Checkpoint[Any]] | None
    ) -> _Base:
        if found is None:
            raise ConflictError(session_id, expected_version, None)
        base = found[0]
        if base.version != expected_version:
            raise ConflictError(session_id, expected_version, base.version)
        return base

    def _validate_on(self, base: _Base, state: Any) -> tuple[S, dict[str, int]]:
        """``state`` validated knowing ``base``, the version it is written on: lists that keep the
        base's items and append have only their new items validated."""
        return self.schema.validate_extending(state, self._known_lists(base))

    @staticmethod
    def _known_lists(base: _Base) -> dict[str, list[Any]]:
        return {name: base.values[name] for name in base.immutable_lists}

    def _encode(
        self, base: _Base, state: S, kept: Mapping[str, int]
    ) -> tuple[JSONState, dict[str, Any], dict[str, Any] | None, frozenset[str]]:
        """The new state's JSON, its Python field values, the delta against the base when it
        falls out of the comparison for free (None: compute it from the JSON), and its list
        fields of immutable items.

        ``kept`` maps list fields already known to be the base's list plus new items (the
        validation found it) to the base's length, so they are not compared again."""
        values = self.schema.field_values(state)
        if not (self._fast_path and base.stored_schema_version == self.schema.version):
            return self.schema.to_json(state), values, None, _immutable_lists(values)
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
        base: _Base,
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
    def _check_step(reason: str, step: int | None) -> None:
        if not reason:
            raise UsageError("a checkpoint needs a reason")
        if step is not None and step < 0:
            raise UsageError(f"step must be >= 0, got {step}")

    def _snapshot_due(self, base: _Base, version: int, replay_bytes: int) -> bool:
        """Whether ``version`` is stored whole: the deltas since the last snapshot (this one's
        included) cost a replay as much as it, at least ``snapshot_every`` versions after it."""
        return version - base.last_full >= self.snapshot_every and replay_bytes >= base.full_bytes

    def _row(
        self,
        base: _Base,
        payload: str,
        *,
        full: bool,
        reason: str,
        step: int | None,
        good: bool | None,
        forked_from: str | None = None,
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
            forked_from=forked_from,
        )

    def _check_append(self, append: Mapping[str, Sequence[Any]], update: Mapping[str, Any]) -> None:
        for name in (*append, *update):
            if name not in self.schema.fields:
                raise UsageError(f"{self.schema.name} has no field {name!r}")
        for name, items in append.items():
            if name in update:
                raise UsageError(f"{name!r} is both appended to and set")
            if isinstance(items, str | bytes | Mapping) or not isinstance(items, Sequence):
                raise UsageError(f"the items to append to {name!r} must be a sequence")

    def _appended_state(
        self, base: _Base, append: Mapping[str, Sequence[Any]], update: Mapping[str, Any]
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
        return self._validate_on(base, fields)

    def _plan_append(
        self,
        base: _Base,
        append: Mapping[str, Sequence[Any]],
        update: Mapping[str, Any],
        *,
        reason: str,
        step: int | None,
        good: bool | None,
    ) -> _AppendPlan | None:
        """The row of an append and what the base becomes, at the cost of what is new; None
        when only the general path (the whole state validated and compared) is sound here."""
        self._check_step(reason, step)
        self._check_append(append, update)
        extensible = self.schema.extensible_lists & base.immutable_lists
        if (
            not (self._fast_path and base.stored_schema_version == self.schema.version)
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
        delta = delta_of(sets, extends, patches)
        payload = json.dumps(delta, separators=(",", ":"), ensure_ascii=False)
        replay_bytes = base.replay_bytes + _payload_bytes(payload) + _ROW_REPLAY_COST
        full_lists: dict[str, list[Any]] | None = None
        full_bytes = base.full_bytes
        if self._snapshot_due(base, base.version + 1, replay_bytes):
            full_lists = {name: [*base.data[name], *items] for name, items in tails_json.items()}
            payload = encode_full({**data, **full_lists})
            full_bytes = _payload_bytes(payload)
            replay_bytes = 0
        row = self._row(
            base, payload, full=full_lists is not None, reason=reason, step=step, good=good
        )
        return _AppendPlan(
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
        )

    def _remember_append(self, plan: _AppendPlan) -> int:
        """Make the committed append the session's cached base; returns its version.

        The base's own lists (never handed to a caller) grow in place while it is the newest
        version this store knows, so an append costs its new items; a base another version
        replaced meanwhile has its lists copied instead."""
        base, row = plan.base, plan.row
        with self._cache_lock:
            current = self._cache.get(base.session_id)
            in_place = current is base
            values = dict(base.values)
            data = dict(plan.data)
            for name, items in plan.tails.items():
                if in_place:
                    values[name].extend(items)
                else:
                    values[name] = [*values[name], *items]
                if plan.full_lists is not None:
                    data[name] = plan.full_lists[name]
                elif in_place:
                    data[name].extend(plan.tails_json[name])
                else:
                    data[name] = [*data[name], *plan.tails_json[name]]
            lists = {name: values[name] for name in (*plan.tails, *plan.unchanged)}
            state = plan.partial.model_copy(update=lists)
            for name, value in self.schema.field_values(cast(S, state)).items():
                if name not in lists:
                    values[name] = list(value) if isinstance(value, list) else value
            new_base = _Base(
                session_id=base.session_id,
                version=row.version,
                epoch=base.epoch,
                step=row.step,
                last_full=row.version if plan.full_lists is not None else base.last_full,
                stored_schema_version=self.schema.version,
                data=data,
                values=values,
                state=state,
                immutable_lists=plan.immutable,
                full_bytes=plan.full_bytes,
                replay_bytes=plan.replay_bytes,
            )
            if current is None or current.epoch != base.epoch or current.version < row.version:
                self._cache[base.session_id] = new_base
        return row.version

    def _write(
        self,
        base: _Base,
        state: S,
        *,
        reason: str,
        step: int | None,
        good: bool | None = None,
        forked_from: str | None = None,
        kept: Mapping[str, int] | None = None,
    ) -> Checkpoint[S]:
        """Commit ``state`` on top of ``base``. ``kept``: the lists ``validate_extending`` built
        (the state is then the store's own, handed to no caller)."""
        row, new_base = self._plan_write(
            base, state, reason=reason, step=step, good=good, forked_from=forked_from, kept=kept
        )
        self.backend.write(
            base.session_id,
            row,
            expected_version=base.version,
            expected_epoch=base.epoch,
            new_epoch=None,
            ttl=None,
            now=row.created_at,
        )
        self._remember(new_base, frozenset(kept or ()))
        return Checkpoint(_info(base.session_id, row), state)

    async def _awrite(
        self,
        base: _Base,
        state: S,
        *,
        reason: str,
        step: int | None,
        good: bool | None = None,
        kept: Mapping[str, int] | None = None,
    ) -> Checkpoint[S]:
        """Async twin of ``_write``."""
        row, new_base = self._plan_write(
            base, state, reason=reason, step=step, good=good, kept=kept
        )
        await self.backend.awrite(
            base.session_id,
            row,
            expected_version=base.version,
            expected_epoch=base.epoch,
            new_epoch=None,
            ttl=None,
            now=row.created_at,
        )
        self._remember(new_base, frozenset(kept or ()))
        return Checkpoint(_info(base.session_id, row), state)

    def _plan_write(
        self,
        base: _Base,
        state: S,
        *,
        reason: str,
        step: int | None,
        good: bool | None = None,
        forked_from: str | None = None,
        kept: Mapping[str, int] | None = None,
    ) -> tuple[StoredCheckpoint, _Base]:
        """The row to append on top of ``base`` and the base it becomes once committed.

        A full snapshot is written on a schema change, or once both ``snapshot_every`` versions
        have passed since the last one and the deltas since then (with this one) cost a replay
        as much as that snapshot's bytes: snapshots then get rarer as the state grows, so the
        stored bytes stay within a small multiple of the deltas' and a read replays about one
        snapshot's worth of deltas, where a snapshot every so many versions would store the
        whole of a growing history over and over."""
        self._check_step(reason, step)
        data, values, delta, immutable = self._encode(base, state, kept or {})
        version = base.version + 1
        full = base.stored_schema_version != self.schema.version
        replay_bytes = 0
        if not full:
            if delta is None:
                delta = diff(base.data, data)
            payload = json.dumps(delta, separators=(",", ":"), ensure_ascii=False)
            replay_bytes = base.replay_bytes + _payload_bytes(payload) + _ROW_REPLAY_COST
            full = self._snapshot_due(base, version, replay_bytes)
        if full:
            payload = encode_full(data)
            replay_bytes = 0
        row = self._row(
            base,
            payload,
            full=full,
            reason=reason,
            step=step,
            good=good,
            forked_from=forked_from,
        )
        new_base = _Base(
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
            full_bytes=_payload_bytes(payload) if full else base.full_bytes,
            replay_bytes=replay_bytes,
        )
        return row, new_base

    def create(
        self,
        session_id: str,
        state: S | Mapping[str, Any],
        *,
        ttl: float | timedelta | None = None,
        reason: str = CheckpointReason.CREATED,
        step: int = 0,
        forked_from: str | None = None,
        good: bool | None = None,
    ) -> Checkpoint[S]:
        """Create a session at version 1 with ``state`` (validated); ``good`` marks that first
        checkpoint as ``mark`` would, in the same write.

        An expired session with the same id is replaced.

        Raises:
            ConflictError: a live session with this id exists (expected None, actual its
                version).
            StateValidationError: the state fails the schema.
        """
        row, epoch, ttl_s, base = self._plan_create(
            session_id, state, ttl, reason, step, forked_from, good
        )
        self.backend.write(
            session_id,
            row,
            expected_version=None,
            expected_epoch=None,
            new_epoch=epoch,
            ttl=ttl_s,
            now=row.created_at,
        )
        self._remember(base)
        return Checkpoint(_info(session_id, row), cast(S, base.state))

    def _plan_create(
        self,
        session_id: str,
        state: S | Mapping[str, Any],
        ttl: float | timedelta | None,
        reason: str,
        step: int,
        forked_from: str | None,
        good: bool | None = None,
    ) -> tuple[StoredCheckpoint, str, float | None, _Base]:
        if not session_id:
            raise UsageError("a session id must not be empty")
        if step < 0:
            raise UsageError(f"step must be >= 0, got {step}")
        typed = self.schema.validate(state)
        data = self.schema.to_json(typed)
        values = self.schema.field_values(typed)
        epoch = secrets.token_hex(8)
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
        base = _Base(
            session_id=session_id,
            version=1,
            epoch=epoch,
            step=step,
            last_full=1,
            stored_schema_version=self.schema.version,
            data=data,
            values=values,
            state=typed,
            immutable_lists=_immutable_lists(values),
            full_bytes=_payload_bytes(payload),
            replay_bytes=0,
        )
        return row, epoch, _seconds(ttl) if ttl is not None else self.default_ttl, base

    def checkpoint(
        self,
        session_id: str,
        state: S | Mapping[str, Any],
        *,
        expected_version: int,
        reason: str,
        step: int | None = None,
        good: bool | None = None,
    ) -> int:
        """Commit ``state`` as the next version if the head is still ``expected_version``.

        Call it before every model call and after every transition. Returns the new version.

        Raises:
            ConflictError: another writer committed first; nothing was written. Re-read and
                decide again.
            StateValidationError: the state fails the schema.
        """
        cached = self._cache.get(session_id)
        if cached is not None and cached.version == expected_version:
            typed, kept = self._validate_on(cached, state)
            base = cached
        else:
            typed, kept = self.schema.validate(state), {}
            base = self._base_for(session_id, expected_version)
        return self._write(base, typed, reason=reason, step=step, good=good, kept=kept).version

    def append(
        self,
        session_id: str,
        append: Mapping[str, Sequence[Any]],
        *,
        expected_version: int,
        reason: str,
        update: Mapping[str, Any] | None = None,
        step: int | None = None,
        good: bool | None = None,
    ) -> int:
        """Commit, as the next version if the head is still ``expected_version``, that
        version with ``append``'s items added to the end of those list fields and ``update``'s
        fields set (replaced, not reduced).

        What ``checkpoint`` of the whole new state does, at a cost that grows with the items
        and fields given, not with the length of the lists they extend: the turn loop of a
        100,000-message session appends a message as cheaply as on its first turn. Returns the
        new version.

        Raises:
            ConflictError: another writer committed first; nothing was written.
            StateValidationError: the new state fails the schema.
            UsageError: an unknown field, or ``append`` names a field that is not a list.
        """
        base = self._base_for(session_id, expected_version)
        plan = self._plan_append(base, append, update or {}, reason=reason, step=step, good=good)
        if plan is None:
            typed, kept = self._appended_state(base, append, update or {})
            return self._write(base, typed, reason=reason, step=step, good=good, kept=kept).version
        self.backend.write(
            session_id,
            plan.row,
            expected_version=base.version,
            expected_epoch=base.epoch,
            new_epoch=None,
            ttl=None,
            now=plan.row.created_at,
        )
        return self._remember_append(plan)

    def update(
        self,
        session_id: str,
        update: Mapping[str, Any],
        *,
        expected_version: int,
        reason: str = CheckpointReason.UPDATE,
        step: int | None = None,
        good: bool | None = None,
    ) -> Checkpoint[S]:
        """Apply ``update`` through the fields' reducers to version ``expected_version`` and
        commit the result as the next version.

        Raises:
            ConflictError: the head is no longer ``expected_version``; nothing was written.
            StateValidationError: an unknown field or an invalid result.
        """
        base = self._base_for(session_id, expected_version)
        new_state = self.schema.apply(cast(S, base.state), update, previous=self._known_lists(base))
        return self._write(base, new_state, reason=reason, step=step, good=good)

    def transact(
        self,
        session_id: str,
        decide: Callable[[S], Mapping[str, Any] | None],
        *,
        reason: str = CheckpointReason.UPDATE,
        step: int | None = None,
        max_attempts: int = 50,
    ) -> Checkpoint[S]:
        """Read, decide, write; on a conflict re-read and decide again (optimistic concurrency).

        ``decide`` gets the latest state and returns the update to apply through the reducers
        (None: nothing to write; the current checkpoint is returned). It may run several times,
        so it must not have side effects.

        Raises:
            ConflictError: still conflicting after ``max_attempts`` attempts.
            StateError: the session does not exist.
        """
        last: ConflictError | None = None
        for attempt in range(max_attempts):
            found = self._read(session_id, None)
            if found is None:
                raise StateError(f"no state stored for session {session_id!r}")
            base, current = found
            update = decide(current.state)
            if update is None:
                return current
            new_state = self.schema.apply(current.state, update, previous=self._known_lists(base))
            try:
                return self._write(base, new_state, reason=reason, step=step)
            except ConflictError as exc:
                last = exc
                # Jittered backoff so many writers on one session do not retry in lockstep.
                time.sleep(secrets.randbelow(1000) / 1_000_000 * min(2**attempt, 64))
        assert last is not None
        raise last

    # --- history ------------------------------------------------------------------------------

    def mark(self, session_id: str, version: int, *, good: bool | None) -> None:
        """Mark a checkpoint good (a revert target) or bad; None clears the mark.

        Raises:
            StateError: that version is not stored.
        """
        if not self.backend.mark(session_id, version, good):
            raise StateError(f"session {session_id!r} has no stored version {version}")

    def revert(
        self,
        session_id: str,
        *,
        expected_version: int,
        to_version: int | None = None,
        reason: str = CheckpointReason.REVERT,
        step: int | None = None,
    ) -> Checkpoint[S]:
        """Commit the state of ``to_version`` (default: the newest checkpoint marked good) as a
        new version. History is append-only: the reverted versions stay readable.

        Raises:
            ConflictError: the head is no longer ``expected_version``.
            StateError: no such version, or no checkpoint is marked good.
        """
        if to_version is None:
            good = self.last_good(session_id)
            if good is None:
                raise StateError(f"session {session_id!r} has no checkpoint marked good")
            to_version = good.version
        target = self.at(session_id, to_version)
        base = self._base_for(session_id, expected_version)
        return self._write(
            base,
            target.state,
            reason=f"{reason} to v{to_version}" if reason == CheckpointReason.REVERT else reason,
            step=target.step if step is None else step,
        )

    def fork(
        self,
        session_id: str,
        new_session_id: str,
        *,
        version: int | None = None,
        ttl: float | timedelta | None = None,
    ) -> Checkpoint[S]:
        """A new session whose version 1 is the state of ``session_id`` at ``version`` (head by
        default). The source session is not changed.

        Raises:
            ConflictError: ``new_session_id`` already exists.
            StateError: no such session or version.
        """
        source = self.load(session_id) if version is None else self.at(session_id, version)
        return self.create(
            new_session_id,
            source.state,
            ttl=ttl,
            reason=CheckpointReason.FORK,
            step=source.step,
            forked_from=f"{session_id}@{source.version}",
        )

    def delete(self, session_id: str) -> bool:
        """Delete a session and its history; False when there was none."""
        with self._cache_lock:
            self._cache.pop(session_id, None)
        return self.backend.delete(session_id)

    def drop_versions(self, session_id: str, versions: Iterable[int]) -> int:
        """Delete these versions of a session's history (the head is always kept), in one
        rewrite; a kept delta whose predecessor goes is rebased as a full snapshot, so every
        kept version stays readable. Returns how many versions were deleted.

        Raises:
            ExpiredError: the session has expired.
        """
        doomed = set(versions)
        now = self.clock()
        rows = self.backend.history(session_id, now)
        if not rows:
            return 0
        keep = {row.version for row in rows if row.version not in doomed}
        keep.add(rows[-1].version)
        if len(keep) == len(rows):
            return 0
        _drop_rows(self.backend, session_id, rows, keep, now)
        with self._cache_lock:
            self._cache.pop(session_id, None)
        return len(rows) - len(keep)

    def vacuum(self) -> VacuumReport:
        """Delete expired sessions and apply the retention policy to every session.

        Retained delta checkpoints whose base is removed are rewritten as full snapshots, so
        every retained version stays readable. The head and the newest good checkpoint are kept.
        """
        report = vacuum(self.backend, self.retention, now=self.clock())
        with self._cache_lock:
            self._cache.clear()
        return report

    # --- locks --------------------------------------------------------------------------------

    @contextmanager
    def lock(
        self, session_id: str, *, ttl: float = 30.0, wait: float = 5.0
    ) -> Iterator[SessionLock]:
        """Hold the advisory lease on a session for the block (see ``SessionLock``).

        Raises:
            DatabaseLockedError: another owner held it for longer than ``wait`` seconds.
        """
        lease = SessionLock(self.backend, f"session:{session_id}", ttl, self.clock)
        if not lease.acquire(wait):
            raise DatabaseLockedError(
                f"session {session_id!r} is locked by another writer (waited {wait}s)"
            )
        try:
            yield lease
        finally:
            if lease.held:
                lease.release()

    def session_lock(self, session_id: str, *, ttl: float = 30.0) -> SessionLock:
        """An unacquired lease object, for code that manages acquire/release itself."""
        return SessionLock(self.backend, f"session:{session_id}", ttl, self.clock)

    def storage_bytes(self) -> int:
        """Bytes the backend uses for state."""
        return self.backend.storage_bytes()

    def close(self) -> None:
        """Close the backend."""
        self.backend.close()

    def __enter__(self) -> StateStore[S]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- async twins ---------------------------------------------------------------------------
    # The same logic as the sync methods; backend calls go through the backend's async twins
    # (native on PostgreSQL and Redis, a worker thread on SQLite).

    async def aget(self, session_id: str) -> Checkpoint[S] | None:
        """Async twin of ``get``."""
        found = await self._aread(session_id, None)
        return None if found is None else found[1]

    async def apeek(self, session_id: str) -> Checkpoint[S] | None:
        """``aget`` for a reader that only reads: the latest checkpoint, its state not copied.

        A read of the version this store last wrote then costs one head row however long the
        state's lists are. The state may be this store's own: read it at once, and never change
        or keep it (a later ``append`` grows its lists in place).
        """
        found = await self._aread(session_id, None, copy=False)
        return None if found is None else found[1]

    async def aload(self, session_id: str) -> Checkpoint[S]:
        """Async twin of ``load``."""
        found = await self.aget(session_id)
        if found is None:
            raise StateError(f"no state stored for session {session_id!r}")
        return found

    async def aat(self, session_id: str, version: int) -> Checkpoint[S]:
        """Async twin of ``at``."""
        found = await self._aread(session_id, version)
        if found is None or found[1].version != version:
            raise StateError(f"session {session_id!r} has no stored version {version}")
        return found[1]

    async def ahistory(self, session_id: str, limit: int | None = None) -> list[CheckpointInfo]:
        """Async twin of ``history``."""
        rows = await self.backend.ahistory(session_id, self.clock())
        infos = [_info(session_id, row) for row in reversed(rows)]
        return infos[:limit] if limit is not None else infos

    async def acreate(
        self,
        session_id: str,
        state: S | Mapping[str, Any],
        *,
        ttl: float | timedelta | None = None,
        reason: str = CheckpointReason.CREATED,
        step: int = 0,
        forked_from: str | None = None,
        good: bool | None = None,
    ) -> Checkpoint[S]:
        """Async twin of ``create``."""
        row, epoch, ttl_s, base = self._plan_create(
            session_id, state, ttl, reason, step, forked_from, good
        )
        await self.backend.awrite(
            session_id,
            row,
            expected_version=None,
            expected_epoch=None,
            new_epoch=epoch,
            ttl=ttl_s,
            now=row.created_at,
        )
        self._remember(base)
        return Checkpoint(_info(session_id, row), cast(S, base.state))

    async def acheckpoint(
        self,
        session_id: str,
        state: S | Mapping[str, Any],
        *,
        expected_version: int,
        reason: str,
        step: int | None = None,
        good: bool | None = None,
    ) -> int:
        """Async twin of ``checkpoint``."""
        cached = self._cache.get(session_id)
        if cached is not None and cached.version == expected_version:
            typed, kept = self._validate_on(cached, state)
            base = cached
        else:
            typed, kept = self.schema.validate(state), {}
            base = await self._abase_for(session_id, expected_version)
        written = await self._awrite(base, typed, reason=reason, step=step, good=good, kept=kept)
        return written.version

    async def aappend(
        self,
        session_id: str,
        append: Mapping[str, Sequence[Any]],
        *,
        expected_version: int,
        reason: str,
        update: Mapping[str, Any] | None = None,
        step: int | None = None,
        good: bool | None = None,
    ) -> int:
        """Async twin of ``append``."""
        base = await self._abase_for(session_id, expected_version)
        plan = self._plan_append(base, append, update or {}, reason=reason, step=step, good=good)
        if plan is None:
            typed, kept = self._appended_state(base, append, update or {})
            written = await self._awrite(
                base, typed, reason=reason, step=step, good=good, kept=kept
            )
            return written.version
        await self.backend.awrite(
            session_id,
            plan.row,
            expected_version=base.version,
            expected_epoch=base.epoch,
            new_epoch=None,
            ttl=None,
            now=plan.row.created_at,
        )
        return self._remember_append(plan)

    async def aupdate(
        self,
        session_id: str,
        update: Mapping[str, Any],
        *,
        expected_version: int,
        reason: str = CheckpointReason.UPDATE,
        step: int | None = None,
        good: bool | None = None,
    ) -> Checkpoint[S]:
        """Async twin of ``update``."""
        base = await self._abase_for(session_id, expected_version)
        new_state = self.schema.apply(cast(S, base.state), update, previous=self._known_lists(base))
        return await self._awrite(base, new_state, reason=reason, step=step, good=good)

    async def atransact(
        self,
        session_id: str,
        decide: Callable[[S], Mapping[str, Any] | None],
        *,
        reason: str = CheckpointReason.UPDATE,
        step: int | None = None,
        max_attempts: int = 50,
    ) -> Checkpoint[S]:
        """Async twin of ``transact``."""
        last: ConflictError | None = None
        for attempt in range(max_attempts):
            found = await self._aread(session_id, None)
            if found is None:
                raise StateError(f"no state stored for session {session_id!r}")
            base, current = found
            update = decide(current.state)
            if update is None:
                return current
            new_state = self.schema.apply(current.state, update, previous=self._known_lists(base))
            try:
                return await self._awrite(base, new_state, reason=reason, step=step)
            except ConflictError as exc:
                last = exc
                await asyncio.sleep(secrets.randbelow(1000) / 1_000_000 * min(2**attempt, 64))
        assert last is not None
        raise last

    async def amark(self, session_id: str, version: int, *, good: bool | None) -> None:
        """Async twin of ``mark``."""
        if not await self.backend.amark(session_id, version, good):
            raise StateError(f"session {session_id!r} has no stored version {version}")

    async def alast_good(self, session_id: str) -> CheckpointInfo | None:
        """Async twin of ``last_good``."""
        for info in await self.ahistory(session_id):
            if info.good:
                return info
        return None

    async def arevert(
        self,
        session_id: str,
        *,
        expected_version: int,
        to_version: int | None = None,
        reason: str = CheckpointReason.REVERT,
        step: int | None = None,
    ) -> Checkpoint[S]:
        """Async twin of ``revert``."""
        if to_version is None:
            good = await self.alast_good(session_id)
            if good is None:
                raise StateError(f"session {session_id!r} has no checkpoint marked good")
            to_version = good.version
        target = await self.aat(session_id, to_version)
        base = await self._abase_for(session_id, expected_version)
        return await self._awrite(
            base,
            target.state,
            reason=f"{reason} to v{to_version}" if reason == CheckpointReason.REVERT else reason,
            step=target.step if step is None else step,
        )

    async def afork(
        self,
        session_id: str,
        new_session_id: str,
        *,
        version: int | None = None,
        ttl: float | timedelta | None = None,
    ) -> Checkpoint[S]:
        """Async twin of ``fork``."""
        source = (
            await self.aload(session_id) if version is None else await self.aat(session_id, version)
        )
        return await self.acreate(
            new_session_id,
            source.state,
            ttl=ttl,
            reason=CheckpointReason.FORK,
            step=source.step,
            forked_from=f"{session_id}@{source.version}",
        )

    async def adelete(self, session_id: str) -> bool:
        """Async twin of ``delete``."""
        with self._cache_lock:
            self._cache.pop(session_id, None)
        return await self.backend.adelete(session_id)

    async def avacuum(self) -> VacuumReport:
        """Async twin of ``vacuum`` (maintenance: runs in a worker thread)."""
        return await asyncio.to_thread(self.vacuum)

    @asynccontextmanager
    async def alock(
        self, session_id: str, *, ttl: float = 30.0, wait: float = 5.0
    ) -> AsyncIterator[SessionLock]:
        """Async twin of ``lock``."""
        lease = SessionLock(self.backend, f"session:{session_id}", ttl, self.clock)
        if not await lease.aacquire(wait):
            raise DatabaseLockedError(
                f"session {session_id!r} is locked by another writer (waited {wait}s)"
            )
        try:
            yield lease
        finally:
            if lease.held:
                await lease.arelease()

    async def aclose(self) -> None:
        """Async twin of ``close``."""
        await self.backend.aclose()


def vacuum(
    backend: StateBackend, retention: Retention, *, now: float | None = None
) -> VacuumReport:
    """Vacuum a backend without knowing its state types (operators, ``keel state vacuum``).

    Deletes expired sessions and applies ``retention`` to every session; kept deltas whose
    predecessor goes are rebased as full snapshots. The head and the newest good checkpoint of
    every session are always kept.
    """
    now = time.time() if now is None else now
    expired = backend.purge_expired(now)
    deleted = rebased = 0
    if retention.keep_last is None and retention.max_age_s is None:
        return VacuumReport(expired_sessions=expired)
    for session_id in backend.sessions():
        try:
            rows = backend.history(session_id, now)
        except ExpiredError:
            continue  # removed by a later vacuum
        if len(rows) <= 1:
            continue
        keep = {row.version for row in rows}
        if retention.keep_last is not None:
            keep = {row.version for row in rows[-retention.keep_last :]}
        if retention.max_age_s is not None:
            cutoff = now - retention.max_age_s
            keep = {row.version for row in rows if row.version in keep and row.created_at >= cutoff}
        keep.add(rows[-1].version)
        good = [row.version for row in rows if row.good]
        if good:
            keep.add(good[-1])
        doomed = [row.version for row in rows if row.version not in keep]
        if not doomed:
            continue
        deleted += len(doomed)
        rebased += _drop_rows(backend, session_id, rows, keep, now)
    return VacuumReport(
        expired_sessions=expired, checkpoints_deleted=deleted, checkpoints_rebased=rebased
    )


def _drop_rows(
    backend: StateBackend,
    session_id: str,
    rows: list[StoredCheckpoint],
    keep: set[int],
    now: float,
) -> int:
    """Delete the versions of ``rows`` not in ``keep`` (never the head) in one rewrite; a kept
    delta whose predecessor goes is rebased as a full snapshot first. Returns how many were
    rebased."""
    replace: list[StoredCheckpoint] = []
    for row in rows:
        if row.version in keep and row.kind == "delta" and (row.version - 1) not in keep:
            chain = backend.read_chain(session_id, row.version, now)
            if chain is None:
                continue
            data = replay(part.payload for part in chain.rows)
            replace.append(replace_dc(chain.rows[-1], kind="full", payload=encode_full(data)))
    doomed = [row.version for row in rows if row.version not in keep]
    backend.rewrite(session_id, doomed, replace)
    return len(replace)
