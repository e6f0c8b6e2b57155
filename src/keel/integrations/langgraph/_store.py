"""A LangGraph store (``BaseStore``) on keel's long-term memory.

Every item is one memory record of the store's scope (one tenant and one user), so the
tenant's other stores never see it and keel's machinery works on it:

- **Namespaces matched label by label.** An item's namespace and key become the record's key:
  each label percent-encoded and closed by ``/``, then ``/`` and the encoded key
  (``langgraph:users/a%25//k``). A label never contains ``/`` once encoded and every label
  ends with one, so an encoded prefix starts a record's key exactly when its labels start the
  item's namespace: ``("users", "a%")`` can never reach ``("users", "ab")``. Keys are compared
  by equality, on the whole key or on its first characters, never with ``LIKE``.
- **A put replaces.** A record added under a key replaces the one that had it, in one
  transaction; ``value=None`` deletes it.
- **``search(query=...)`` is keel's hybrid search**: keyword (BM25) and vector candidates
  fused, scored, within the namespace prefix; the score comes back on each ``SearchItem``. A
  search reads its own writes: items put before it whose vectors the outbox has not made yet
  are embedded first (the scope's own, only when there are any), so a ``put`` never waits for
  its embedding and a search never misses what was put.
  Without a query, the items under the prefix come newest first.
- **TTL** in minutes as LangGraph defines it: a record expires that long after its last write
  (or read, with ``refresh_ttl``); an expired item is never returned and `sweep_ttl`
  deletes what expired.
- **PII masked before it is stored**, as [`keel.memory.Memory.add`][] masks (through the
  scope's user's vault when the memory has one, and then read back as it was put): the value
  (every string in it) and the text searched. Namespaces and keys are identifiers, stored as
  given like the scope's tenant and user: masked, two users' emails would become one label.

    from keel.integrations.langgraph import KeelStore
    store = KeelStore(memory, tenant="acme")
    graph = builder.compile(store=store)
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import quote, unquote

try:
    from langgraph.store.base import (
        BaseStore,
        GetOp,
        InvalidNamespaceError,
        Item,
        ListNamespacesOp,
        MatchCondition,
        Op,
        PutOp,
        Result,
        SearchItem,
        SearchOp,
        TTLConfig,
        get_text_at_path,
        validate_op_namespace,
    )
except ImportError as exc:  # pragma: no cover - the extra is installed in tests
    from keel.errors import BackendUnavailableError

    raise BackendUnavailableError("LangGraph is not installed (the 'langgraph' extra)") from exc

from keel._bridge import run_blocking
from keel.errors import UsageError
from keel.memory import Memory, MemoryFilter, MemoryKind, MemoryRecord, Scope

__all__ = ["KeelStore"]

DEFAULT_USER = "langgraph"
"""The user a store acts for when none is given: the tenant's graphs share their items, kept
apart from the memories of the tenant's end users."""

# Items are what a graph knows (facts, preferences, instructions it keeps): semantic memory.
_KIND: MemoryKind = "semantic"
# Items whose text search sees; the others (index=False, nothing at the index paths) are
# reached by key and by listing only, as LangGraph's own stores leave them out of a query.
_SEARCHED = "langgraph"
_UNSEARCHED = "langgraph-unindexed"
_ITEM_TYPES = (_SEARCHED, _UNSEARCHED)
_KEY_ROOT = "langgraph:"
# list_records' limit when every match is needed (a value filter is applied after the read).
_EVERY = sys.maxsize


def _namespace_key(namespace: Sequence[str]) -> str:
    """The start every record key of ``namespace`` and of the namespaces below it has."""
    return _KEY_ROOT + "".join(quote(label, safe="") + "/" for label in namespace)


def _record_key(namespace: Sequence[str], key: str) -> str:
    """The record key of one item: its namespace's, then ``/`` and the encoded key."""
    return _namespace_key(namespace) + "/" + quote(key, safe="")


def _parse_record_key(record_key: str) -> tuple[tuple[str, ...], str]:
    """The namespace and key a record key was made from."""
    path, _, key = record_key.removeprefix(_KEY_ROOT).partition("//")
    return tuple(unquote(label) for label in path.split("/")), unquote(key)


def _utcnow() -> datetime:
    return datetime.now(UTC)


def _index_text(value: Mapping[str, Any], paths: Sequence[str]) -> str:
    """The text searched for an item: what its index paths hold (``$``: the whole value)."""
    texts = [text for path in paths for text in get_text_at_path(value, path)]
    return "\n".join(text for text in texts if text.strip())


def _matches_condition(condition: MatchCondition, namespace: tuple[str, ...]) -> bool:
    """Whether ``namespace`` starts (prefix) or ends (suffix) with the condition's labels,
    ``*`` standing for any one label."""
    path = tuple(condition.path)
    if len(namespace) < len(path):
        return False
    if condition.match_type == "prefix":
        labels = namespace[: len(path)]
    elif condition.match_type == "suffix":
        labels = namespace[len(namespace) - len(path) :]
    else:
        raise UsageError(f"unknown namespace match type {condition.match_type!r}")
    return all(want in ("*", label) for want, label in zip(path, labels, strict=True))


def _compare(actual: Any, operator: str, operand: Any) -> bool:
    if operator == "$eq":
        return bool(actual == operand)
    if operator == "$ne":
        return bool(actual != operand)
    if operator not in ("$gt", "$gte", "$lt", "$lte"):
        raise UsageError(f"unknown filter operator {operator!r} ($eq $ne $gt $gte $lt $lte)")
    numbers = all(isinstance(v, int | float) and not isinstance(v, bool) for v in (actual, operand))
    if not numbers and not (isinstance(actual, str) and isinstance(operand, str)):
        return False  # values of different types (or a missing field) never compare
    if operator == "$gt":
        return bool(actual > operand)
    if operator == "$gte":
        return bool(actual >= operand)
    if operator == "$lt":
        return bool(actual < operand)
    return bool(actual <= operand)


def _satisfies(actual: Any, expected: Any) -> bool:
    """LangGraph's filter semantics: equality, nested objects field by field, operators."""
    if isinstance(expected, Mapping):
        if any(str(name).startswith("$") for name in expected):
            return all(_compare(actual, str(op), operand) for op, operand in expected.items())
        return isinstance(actual, Mapping) and all(
            _satisfies(actual.get(name), want) for name, want in expected.items()
        )
    if isinstance(expected, list | tuple):
        return (
            isinstance(actual, list | tuple)
            and len(actual) == len(expected)
            and all(_satisfies(a, e) for a, e in zip(actual, expected, strict=True))
        )
    return bool(actual == expected)


class KeelStore(BaseStore):
    """A LangGraph ``BaseStore`` whose items are keel memory records of one scope.

    Args:
        memory: where items live; its masker masks them and its embedder makes the vectors
            (in the outbox, off the write path; a search embeds what is still waiting).
        tenant: the tenant every read and write is confined to.
        user: the user within the tenant (the tenant's graphs share ``"langgraph"``).
        fields: the value paths searched when a put gives no ``index`` (LangGraph's
            ``IndexConfig["fields"]``; ``"$"`` is the whole value).
        ttl: LangGraph's TTL settings (``default_ttl`` minutes, ``refresh_on_read``).
        clock: the current time, for expiry (a test moves it instead of sleeping).
    """

    supports_ttl = True

    def __init__(
        self,
        memory: Memory,
        *,
        tenant: str,
        user: str = DEFAULT_USER,
        fields: Sequence[str] = ("$",),
        ttl: TTLConfig | None = None,
        clock: Callable[[], datetime] = _utcnow,
    ) -> None:
        self.memory = memory
        self.scope = Scope(tenant_id=tenant, user_id=user)
        self.fields = tuple(fields)
        self.ttl_config = ttl
        self._clock = clock

    # --- BaseStore ----------------------------------------------------------------------

    def batch(self, ops: Iterable[Op]) -> list[Result]:
        """Run ``ops`` in order, each seeing what the ones before it wrote."""
        results: list[Result] = []
        for op in ops:
            # Ops given straight to batch skip BaseStore's checks of their labels.
            validate_op_namespace(op)
            if isinstance(op, GetOp):
                results.append(self._get(op))
            elif isinstance(op, PutOp):
                self._put(op)
                results.append(None)
            elif isinstance(op, SearchOp):
                results.append(self._search(op))
            elif isinstance(op, ListNamespacesOp):
                results.append(self._list_namespaces(op))
            else:
                raise UsageError(f"unknown store operation {type(op).__name__}")
        return results

    async def abatch(self, ops: Iterable[Op]) -> list[Result]:
        """Async twin of [`batch`][] (keel's memory stores are synchronous: run off the loop)."""
        pending = list(ops)
        return await run_blocking(self.batch, pending)

    def sweep_ttl(self) -> int:
        """Delete this store's expired items (reads already leave them out); returns how
        many."""
        return self.memory.store.purge_expired(self.scope, self._clock())

    async def asweep_ttl(self) -> int:
        """Async twin of [`sweep_ttl`][]."""
        return await run_blocking(self.sweep_ttl)

    # --- operations ---------------------------------------------------------------------

    def _records(self, filters: MemoryFilter, limit: int) -> list[MemoryRecord]:
        """This scope's item records that pass ``filters``, newest first."""
        return self.memory.store.list_records(self.scope, filters, limit=limit)

    def _current(self, record_key: str, now: datetime) -> MemoryRecord | None:
        found = self._records(
            MemoryFilter(types=_ITEM_TYPES, keys=(record_key,), alive_at=now), limit=1
        )
        return found[0] if found else None

    def _get(self, op: GetOp) -> Item | None:
        now = self._clock()
        record = self._current(_record_key(op.namespace, op.key), now)
        if record is None:
            return None
        if op.refresh_ttl:
            self._refresh([record], now)
        return self._item(record)

    def _put(self, op: PutOp) -> None:
        record_key = _record_key(op.namespace, op.key)
        if op.value is None:
            # Expired records too: a deleted item's data must not wait for the sweep.
            for record in self._records(
                MemoryFilter(types=_ITEM_TYPES, keys=(record_key,), include_expired=True),
                limit=_EVERY,
            ):
                self.memory.forget(self.scope, record.id)
            return
        if not op.namespace:
            raise InvalidNamespaceError("Namespace cannot be empty.")
        now = self._clock()
        value = dict(op.value)
        previous = self._current(record_key, now)
        paths: Sequence[str] = self.fields if op.index is None else (op.index or ())
        text = _index_text(value, paths)
        self.memory.add(
            text or json.dumps(value, sort_keys=True, ensure_ascii=False, default=str),
            scope=self.scope,
            kind=_KIND,
            type=_SEARCHED if text else _UNSEARCHED,
            key=record_key,
            expires_at=None if op.ttl is None else now + timedelta(minutes=op.ttl),
            metadata={
                "value": value,
                # A replaced item keeps the time it was first put.
                "created_at": (
                    None if previous is None else self._item(previous).created_at.timestamp()
                ),
                "ttl_minutes": op.ttl,
            },
        )

    def _search(self, op: SearchOp) -> list[SearchItem]:
        now = self._clock()
        prefix = _namespace_key(op.namespace_prefix)
        wanted = max(op.offset, 0) + max(op.limit, 0)
        expected = None if not op.filter else self._masked(op.filter)
        found: list[tuple[MemoryRecord, float | None]]
        if op.query and op.query.strip():
            # Read-your-writes: items put before this search and not embedded yet are
            # embedded now (this scope's only), so the vector side finds them too.
            self.memory.index_pending(self.scope)
            # The value filter applies after ranking: rank every candidate the retrievers
            # give, so the filter still has them to choose from.
            k = max(wanted, 2 * self.memory.config.candidates) if expected else wanted
            hits = self.memory.search(
                op.query,
                scope=self.scope,
                k=k,
                filters=MemoryFilter(types=(_SEARCHED,), key_prefix=prefix, alive_at=now),
                distinct=False,
            )
            found = [(hit.record, hit.score) for hit in hits]
        else:
            filters = MemoryFilter(types=_ITEM_TYPES, key_prefix=prefix, alive_at=now)
            records = self._records(filters, limit=_EVERY if expected else wanted)
            found = [(record, None) for record in records]
        if expected is not None:
            found = [
                (record, score)
                for record, score in found
                if _satisfies(record.metadata.get("value", {}), expected)
            ]
        page = found[max(op.offset, 0) : wanted]
        if op.refresh_ttl:
            self._refresh([record for record, _ in page], now)
        return [self._search_item(record, score) for record, score in page]

    def _list_namespaces(self, op: ListNamespacesOp) -> list[tuple[str, ...]]:
        conditions = tuple(op.match_conditions or ())
        # The longest literal start of a prefix condition narrows the read; the conditions
        # themselves are checked on each namespace, label by label.
        known: tuple[str, ...] = ()
        for condition in conditions:
            if condition.match_type == "prefix":
                literal: list[str] = []
                for label in condition.path:
                    if label == "*":
                        break
                    literal.append(label)
                known = max(known, tuple(literal), key=len)
        filters = MemoryFilter(
            types=_ITEM_TYPES, key_prefix=_namespace_key(known), alive_at=self._clock()
        )
        namespaces = {
            _parse_record_key(record.key)[0]
            for record in self._records(filters, limit=_EVERY)
            if record.key is not None
        }
        matched = {
            namespace
            for namespace in namespaces
            if all(_matches_condition(condition, namespace) for condition in conditions)
        }
        if op.max_depth is not None:
            matched = {namespace[: op.max_depth] for namespace in matched}
        return sorted(matched)[max(op.offset, 0) : max(op.offset, 0) + max(op.limit, 0)]

    # --- helpers ------------------------------------------------------------------------

    def _refresh(self, records: Sequence[MemoryRecord], now: datetime) -> None:
        """Restart the TTL of the records that have one (LangGraph's refresh on read)."""
        expiry: dict[str, datetime | None] = {}
        for record in records:
            minutes = record.metadata.get("ttl_minutes")
            if isinstance(minutes, int | float):
                expiry[record.id] = now + timedelta(minutes=minutes)
        self.memory.store.set_expiry(self.scope, expiry)

    def _masked(self, value: Any) -> Any:
        """A filter as the stored values were masked (each string on its own, through the
        scope's privacy view), so it compares with what was stored."""
        return self.memory.view(self.scope).mask_value(value)

    def _item(self, record: MemoryRecord) -> Item:
        assert record.key is not None  # item records are always keyed
        namespace, key = _parse_record_key(record.key)
        created = record.metadata.get("created_at")
        # The scope's own values come back as they were put (with a vault; else as stored).
        value = self.memory.view(self.scope).reveal_value(record.metadata.get("value"))
        return Item(
            namespace=namespace,
            key=key,
            value=value if isinstance(value, dict) else {},
            created_at=(
                datetime.fromtimestamp(created, UTC)
                if isinstance(created, int | float)
                else record.created_at
            ),
            # Each put stores a new record: its time is the item's last update.
            updated_at=record.created_at,
        )

    def _search_item(self, record: MemoryRecord, score: float | None) -> SearchItem:
        item = self._item(record)
        return SearchItem(
            namespace=item.namespace,
            key=item.key,
            value=item.value,
            created_at=item.created_at,
            updated_at=item.updated_at,
            score=score,
        )

    def __repr__(self) -> str:
        return f"KeelStore({self.memory!r}, tenant={self.scope.tenant_id!r})"
