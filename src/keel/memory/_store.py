"""The interface every memory backend implements (SQLite embedded, PostgreSQL).

Every method takes a [`Scope`][] and applies it in the backend's own query, so a caller can
never read or touch another tenant's or user's records, whatever else it passes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from keel._bridge import run_blocking
from keel.memory._records import MemoryFilter, MemoryKind, MemoryRecord, Scope

__all__ = ["InsertResult", "MemoryStore", "OutboxEntry", "ScoredId"]

FloatArray = npt.NDArray[np.float32]
_T = TypeVar("_T")


@dataclass(frozen=True)
class ScoredId:
    """A candidate from one retriever: the record id and the retriever's score (higher wins)."""

    record_id: str
    score: float


@dataclass(frozen=True)
class InsertResult:
    """What ``insert`` did: the stored record, whether it is new, and what it superseded."""

    record: MemoryRecord
    created: bool
    superseded: tuple[str, ...] = ()


@dataclass(frozen=True)
class OutboxEntry:
    """A record waiting to be embedded (written with the record, in the same transaction)."""

    id: int
    record_id: str
    tenant_id: str
    user_id: str
    text: str
    attempts: int
    session_id: str | None = None
    """The record's session, when it is a turn of one (its context comes from there)."""
    turn: int | None = None
    """The record's turn in that session."""


class MemoryStore(ABC):
    """Durable storage and candidate search for memory records.

    Implementations: ``keel.stores.SQLiteMemoryStore`` (embedded, exact vector search over a
    numpy matrix kept in step with the rows) and ``keel.stores.PostgresMemoryStore``
    (tsvector + pgvector HNSW), both over ``keel.stores`` ``SQLMemoryStore``.

    Sync/async contract: every method is blocking and thread-safe, with no async twins: a
    memory operation is several store calls and an embedding, so [`keel.memory.Memory`][]
    runs the whole operation through [`acall`][] for its async API: on keel's blocking pool
    (`keel._bridge.run_blocking`), or inline where the engine says a call is as cheap as the
    thread switch would be.
    """

    #: Whether a search's keyword and vector queries gain from running at once (each a round
    #: trip to a server). An embedded engine's are work on this process's CPUs: run one after
    #: the other, they cost no thread switch and no passing of the GIL between them.
    concurrent_searches: bool = True

    async def acall(self, call: Callable[[], _T]) -> _T:
        """Run ``call``, a memory operation of blocking store calls, for an event loop: on
        keel's blocking pool unless the backend runs it another way (SQLite: inline while it
        would not wait for a lock, as its other stores' writes)."""
        return await run_blocking(call)

    def searches_inline(self, scope: Scope, model: str | None) -> bool:
        """Whether a search of ``scope`` (by vectors of ``model``; None: keywords only)
        costs little enough to run on an event loop's thread: a few milliseconds at most,
        whatever it finds. False by default."""
        return False

    @abstractmethod
    def setup(self) -> None:
        """Create or migrate the schema (idempotent)."""

    @abstractmethod
    def insert(self, record: MemoryRecord) -> InsertResult:
        """Store a record and its outbox entry in one transaction.

        Idempotent on ``(scope, content_hash)``: the existing record is returned, nothing is
        duplicated or deleted. A current semantic record with the same subject and attribute
        is superseded (its ``valid_to`` set to the new record's ``valid_from``); a fact's value
        that held before and not now holds again as a new record, a new validity interval
        (its hash made unique with `keel.memory._records.reopened`). A record with
        a ``key`` replaces (deletes) the scope's record under that key, in the same
        transaction.
        """

    def insert_many(self, records: Sequence[MemoryRecord]) -> list[InsertResult]:
        """[`insert`][] each of ``records``, in order; one transaction where the backend can
        (SQLite: a turn's records cost one commit, not one each)."""
        return [self.insert(record) for record in records]

    @abstractmethod
    def get(self, scope: Scope, record_id: str) -> MemoryRecord | None:
        """One record of ``scope`` by id (None if absent or another scope's)."""

    @abstractmethod
    def fetch(
        self, scope: Scope, record_ids: Sequence[str], filters: MemoryFilter
    ) -> list[MemoryRecord]:
        """The records of ``scope`` among ``record_ids`` that pass ``filters`` (any order)."""

    def fetch_by_id(
        self, scope: Scope, record_ids: Sequence[str], filters: MemoryFilter
    ) -> dict[str, MemoryRecord]:
        """[`fetch`][]'s records by id: what a search's ranking reads (in no order it needs),
        which a backend may serve from records it keeps."""
        return {record.id: record for record in self.fetch(scope, record_ids, filters)}

    @abstractmethod
    def list_records(
        self, scope: Scope, filters: MemoryFilter, *, limit: int = 50, newest_first: bool = True
    ) -> list[MemoryRecord]:
        """Records of ``scope`` by creation time (the exact, deterministic tier)."""

    @abstractmethod
    def fact_history(self, scope: Scope, subject: str, attribute: str) -> list[MemoryRecord]:
        """Every value a semantic fact has had, oldest first."""

    @abstractmethod
    def session_turns(
        self, scope: Scope, session_id: str, first_turn: int, last_turn: int
    ) -> list[MemoryRecord]:
        """Records of one session with ``first_turn <= turn <= last_turn``, in turn order."""

    def turns_around(
        self, scope: Scope, spans: Sequence[tuple[str, int, int]]
    ) -> list[MemoryRecord]:
        """The records of every ``(session_id, first_turn, last_turn)`` span, each once, in
        session and turn order: what ``session_turns`` gives for each span, read together.

        Search reads the neighbouring turns of all its hits with it, so a backend where a
        query is a round trip overrides it with one query."""
        found: dict[str, MemoryRecord] = {}
        for session_id, first_turn, last_turn in spans:
            for record in self.session_turns(scope, session_id, first_turn, last_turn):
                found.setdefault(record.id, record)
        return sorted(found.values(), key=lambda r: (r.session_id or "", r.turn or 0))

    @abstractmethod
    def keyword_search(
        self, scope: Scope, terms: Sequence[str], filters: MemoryFilter, limit: int
    ) -> list[ScoredId]:
        """Full-text candidates matching any of ``terms`` (already safe words), best first."""

    @abstractmethod
    def vector_search(
        self, scope: Scope, vector: FloatArray, model: str, filters: MemoryFilter, limit: int
    ) -> list[ScoredId]:
        """Nearest records by cosine similarity among vectors made by ``model``, best first."""

    @abstractmethod
    def vectors(self, scope: Scope, record_ids: Sequence[str], model: str) -> dict[str, FloatArray]:
        """Stored unit vectors of the given records (those that have one)."""

    @abstractmethod
    def pending(
        self, limit: int, max_attempts: int = 5, *, scope: Scope | None = None
    ) -> list[OutboxEntry]:
        """Outbox entries not processed yet with fewer than ``max_attempts`` failures, oldest
        first; of ``scope``'s records only when it is given."""

    @abstractmethod
    def count_pending(self, max_attempts: int = 5) -> int:
        """How many outbox entries [`pending`][] would return without a limit, counted by
        the backend in one query (no entry is read)."""

    @abstractmethod
    def complete(
        self, entries: Sequence[OutboxEntry], vectors: Sequence[FloatArray], model: str
    ) -> None:
        """Store vectors for ``entries`` and remove them from the outbox, atomically."""

    @abstractmethod
    def fail(self, entries: Sequence[OutboxEntry], error: str) -> None:
        """Record a failed attempt (the entries stay in the outbox)."""

    @abstractmethod
    def enqueue_reembed(self, model: str) -> int:
        """Queue every record whose vector is missing or not from ``model``; returns the count."""

    @abstractmethod
    def embedding_models(self) -> dict[str, int]:
        """How many records each embedding model embedded ('' for not embedded yet)."""

    @abstractmethod
    def set_expiry(self, scope: Scope, expiry: Mapping[str, datetime | None]) -> None:
        """Change when records of ``scope`` expire (record id -> new time; None: never)."""

    @abstractmethod
    def purge_expired(self, scope: Scope | None, now: datetime) -> int:
        """Delete the records of ``scope`` (of every scope when None) expired by ``now``;
        returns how many."""

    @abstractmethod
    def delete(self, scope: Scope, record_id: str) -> bool:
        """Delete one record of ``scope`` (and its vector); True if it existed."""

    @abstractmethod
    def count(self, scope: Scope | None = None) -> int:
        """Number of records in ``scope`` (in the whole store when None)."""

    # --- a user's erasure and retention: defaults raise; keel's SQL stores implement them ----

    def user_sessions(self, tenant_id: str, user_id: str) -> list[str]:
        """The sessions the user's records came from (where a user's erasure looks for what
        else of theirs there is)."""
        raise NotImplementedError(f"{type(self).__name__} cannot list a user's sessions")

    def erase_user(self, tenant_id: str, user_id: str) -> dict[str, int]:
        """Delete every record of the user's scope with its vectors, keyword index entries and
        outbox rows (a user's erasure); what was removed, by table. Idempotent."""
        raise NotImplementedError(f"{type(self).__name__} cannot erase a user")

    def tenants(self) -> list[str]:
        """The tenants that have records (retention applies a default policy to each)."""
        raise NotImplementedError(f"{type(self).__name__} cannot list its tenants")

    def prune(
        self, tenant_id: str, kind: MemoryKind, *, before: datetime | None, keep: int | None
    ) -> int:
        """Delete the ``kind`` records of ``tenant_id`` created before ``before`` (None: any
        age), and those beyond each user's newest ``keep`` of that kind (None: any number);
        how many went. Idempotent: several workers may prune at once."""
        raise NotImplementedError(f"{type(self).__name__} cannot prune")

    @abstractmethod
    def close(self) -> None:
        """Release connections."""
