"""Memory: the long-term tiers of an agent, behind one object.

Write path: ``add`` masks PII, then commits the row and an outbox entry in one transaction and
returns; the `OutboxIndexer` (a background worker on the bridge loop, or
``process_outbox`` / ``flush``) embeds and indexes the vector later, so a crash between the two
is repaired by processing the outbox on the next start.

Read path (`Retriever`): exact look-ups (profile facts, recent
actions), then keyword + vector candidates fused by weighted reciprocal rank, a calibrated
similarity floor, recency weighting, de-duplication / MMR, neighbouring turns, an optional
one-call model judge, and packing into an exact token budget.

The store is blocking (SQLite, or PostgreSQL through its sync driver): the sync methods are
the implementation, and each async twin runs its sync method through
`keel._bridge.run_blocking`; the model judge, the one async step, is awaited by
``aretrieve`` and run through the bridge by ``retrieve``.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from keel._bridge import run_blocking, run_sync
from keel.errors import KeelError, UsageError
from keel.memory._config import RetrievalConfig
from keel.memory._embedders import Embedder
from keel.memory._judge import ModelJudge
from keel.memory._outbox import EmbeddingStatus, OutboxIndexer
from keel.memory._packing import PackedMemory
from keel.memory._records import (
    MemoryFilter,
    MemoryKind,
    MemoryRecord,
    Provenance,
    Scope,
    content_hash,
    mask_text,
    utcnow,
)
from keel.memory._retrieval import RUN_TYPE, MemoryHit, Retriever
from keel.memory._store import MemoryStore
from keel.messages import ToolCall
from keel.privacy import DEFAULT_MASKER, PIIMasker, PrivacyView, Vault, privacy_view
from keel.tokens import ChatTokenCounter, counter_for

__all__ = ["EmbeddingStatus", "Memory", "MemoryHit", "ReplayExample"]

_T = TypeVar("_T")


class ReplayExample(BaseModel):
    """A successful earlier run, retrieved as a few-shot example."""

    model_config = ConfigDict(frozen=True)

    record_id: str = Field(description="The run's memory record.")
    task: str = Field(description="What the user asked for (masked).")
    tool_calls: tuple[ToolCall, ...] = Field(description="The tool calls that worked, in order.")
    score: float = Field(description="Relevance to the current task.")

    def render(self) -> str:
        """The example as prompt text."""
        lines = [f"Task: {self.task}", "Tool calls that worked:"]
        lines.extend(f"- {call.name}({call.arguments})" for call in self.tool_calls)
        return "\n".join(lines)


class Memory:
    """An agent's long-term memory: write safely, retrieve accurately, pack exactly.

    Args:
        store: a backend (``keel.stores.SQLiteMemoryStore`` or ``PostgresMemoryStore``).
        embedder: makes vectors; None keeps memory keyword-only.
        masker: masks PII and secrets before anything is stored; ``None`` turns masking off
            (explicitly: pass ``masker=None``).
        config: retrieval settings.
        token_model: model whose tokenizer counts the packing budget.
        judge: optional model judge (one batched call per retrieval).
        background: embed in a background worker (True) or only on ``process_outbox``/``flush``.
        vault: the PII vault the records' values go to (``Backends.open`` gives the stores'
            own): a write masks through the view of its scope's user ([`view`][]), so a
            value has the placeholder it has in that user's turns and reads back as itself.
            None: placeholders are numbered per text and the values are gone.

    Example:
        >>> from keel.memory import Scope
        >>> from keel.settings import load_settings
        >>> from keel.stores import Backends
        >>> backends = Backends.open("sqlite:///memory.db", settings=load_settings())
        >>> memory = backends.memory  # on the stores' database, its vault and masker
        >>> scope = Scope(tenant_id="acme", user_id="u1")
        >>> memory.add("I'm vegetarian", scope=scope, kind="semantic")
        >>> memory.flush()
        >>> memory.retrieve("what should I cook?", scope=scope, budget_tokens=300).text
    """

    def __init__(
        self,
        store: MemoryStore,
        *,
        embedder: Embedder | None = None,
        masker: PIIMasker | None = DEFAULT_MASKER,
        config: RetrievalConfig | None = None,
        token_model: str = "gpt-4o",
        judge: ModelJudge | None = None,
        background: bool = False,
        batch_size: int = 64,
        max_attempts: int = 5,
        vault: Vault | None = None,
    ) -> None:
        self.store = store
        self.vault = vault
        self.embedder = embedder
        self.masker = masker
        self.config = config or RetrievalConfig()
        self.counter: ChatTokenCounter = counter_for(token_model, allow_estimate=True)
        self.judge = judge
        self.batch_size = batch_size
        self.max_attempts = max_attempts
        self.last_error: str | None = None
        self.store.setup()
        self.indexer = OutboxIndexer(
            store,
            embedder,
            context_turns=self.config.context_turns,
            batch_size=batch_size,
            max_attempts=max_attempts,
            on_error=self._note_error,
        )
        self.retriever = Retriever(store, embedder, masker, self.config, self._note_error)
        if background:
            self.start()

    def _note_error(self, message: str) -> None:
        """An embedding failed (a batch's, or a query's): the message is ``last_error``."""
        self.last_error = message

    def view(self, scope: Scope) -> PrivacyView:
        """How a write to ``scope`` masks (and a read of it may reveal): through the scope's
        user's view of the vault, or the masker alone without one."""
        return privacy_view(self.masker, scope.tenant_id, scope.user_id, self.vault)

    # --- write path ---------------------------------------------------------------------

    def add(
        self,
        text: str,
        *,
        scope: Scope,
        kind: MemoryKind = "episodic",
        type: str = "note",
        provenance: Provenance = "user_claim",
        verified_by: str | None = None,
        session_id: str | None = None,
        step: int | None = None,
        turn: int | None = None,
        event_time: datetime | None = None,
        subject: str | None = None,
        attribute: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        key: str | None = None,
        expires_at: datetime | None = None,
    ) -> MemoryRecord:
        """Store a memory durably and return at once (embedding happens later).

        PII is masked first, through the scope's user's vault when the memory has one.
        Adding identical content twice returns the first record.
        A semantic record with ``subject`` and ``attribute`` supersedes the current value (a
        value the fact had before holds again as a new record, from now on; the current value
        added again is returned as it is).
        A record added under ``key`` replaces the scope's record under that key (a key is an
        identifier, stored as given, like the scope's ids); ``expires_at`` makes it expire.

        Raises:
            UsageError: empty text, or ``provenance="verified"`` without ``verified_by``
                (a user's claim is never stored as verified).
        """
        return self._insert(
            [
                self._draft(
                    text,
                    scope=scope,
                    kind=kind,
                    type=type,
                    provenance=provenance,
                    verified_by=verified_by,
                    session_id=session_id,
                    step=step,
                    turn=turn,
                    event_time=event_time,
                    subject=subject,
                    attribute=attribute,
                    metadata=metadata,
                    key=key,
                    expires_at=expires_at,
                )
            ]
        )[0]

    def add_many(self, entries: Sequence[Mapping[str, Any]], *, scope: Scope) -> list[MemoryRecord]:
        """Store several memories of ``scope`` in one transaction (all or none); each entry
        holds [`add`][]'s keyword arguments, ``text`` among them. What each returns is what
        ``add`` would (a content stored already is the record stored first).

        Raises:
            UsageError: an entry [`add`][] would refuse (nothing is stored then).
        """
        return self._insert([self._draft(scope=scope, **entry) for entry in entries])

    def _insert(self, records: Sequence[MemoryRecord]) -> list[MemoryRecord]:
        """Store ``records`` in one transaction and wake the outbox worker for the new ones."""
        results = self.store.insert_many(records)
        created = sum(1 for result in results if result.created)
        if created:
            self.indexer.notify_work(added=created)
        return [result.record for result in results]

    def _draft(
        self,
        text: str,
        *,
        scope: Scope,
        kind: MemoryKind = "episodic",
        type: str = "note",
        provenance: Provenance = "user_claim",
        verified_by: str | None = None,
        session_id: str | None = None,
        step: int | None = None,
        turn: int | None = None,
        event_time: datetime | None = None,
        subject: str | None = None,
        attribute: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        key: str | None = None,
        expires_at: datetime | None = None,
    ) -> MemoryRecord:
        """The masked record ``add`` would store (see [`add`][])."""
        if not text.strip():
            raise UsageError("a memory needs non-empty text")
        if provenance == "verified" and not verified_by:
            raise UsageError(
                "provenance='verified' needs verified_by (the tool or system that checked it); "
                "store what the user said as provenance='user_claim'"
            )
        if (subject is None) != (attribute is None):
            raise UsageError("a fact needs both subject and attribute, or neither")
        if subject is not None and kind != "semantic":
            raise UsageError("subject/attribute facts are semantic memories (kind='semantic')")
        view = self.view(scope)
        masked = view.mask(text)
        subject_m = None if subject is None else view.mask(subject)
        attribute_m = None if attribute is None else view.mask(attribute)
        now = utcnow()
        return MemoryRecord(
            id=uuid.uuid4().hex,
            tenant_id=scope.tenant_id,
            user_id=scope.user_id,
            kind=kind,
            type=type,
            text=masked,
            provenance=provenance,
            verified_by=verified_by,
            session_id=session_id,
            step=step,
            turn=turn,
            created_at=now,
            event_time=event_time,
            subject=subject_m,
            attribute=attribute_m,
            valid_from=(event_time or now) if subject_m is not None else None,
            content_hash=content_hash(kind, type, masked, subject_m, attribute_m, key),
            metadata=view.mask_value(dict(metadata or {})),
            key=key,
            expires_at=expires_at,
        )

    async def aadd(self, text: str, *, scope: Scope, **fields: Any) -> MemoryRecord:
        """Async twin of [`add`][] (through the store's [`acall`][keel.memory.MemoryStore.acall]:
        inline on SQLite while no other writer holds the lock)."""
        return await self.store.acall(lambda: self.add(text, scope=scope, **fields))

    async def aadd_many(
        self, entries: Sequence[Mapping[str, Any]], *, scope: Scope
    ) -> list[MemoryRecord]:
        """Async twin of [`add_many`][] (run as [`aadd`][] runs)."""
        return await self.store.acall(lambda: self.add_many(entries, scope=scope))

    def remember_fact(
        self,
        scope: Scope,
        subject: str,
        attribute: str,
        value: str,
        *,
        provenance: Provenance = "user_claim",
        verified_by: str | None = None,
        event_time: datetime | None = None,
        session_id: str | None = None,
    ) -> MemoryRecord:
        """Store ``subject``'s ``attribute`` = ``value``; an earlier value becomes history."""
        return self.add(
            f"{subject} {attribute}: {value}",
            scope=scope,
            kind="semantic",
            type="fact",
            provenance=provenance,
            verified_by=verified_by,
            subject=subject,
            attribute=attribute,
            event_time=event_time,
            session_id=session_id,
            metadata={"value": value},
        )

    def remember_run(
        self,
        scope: Scope,
        task: str,
        tool_calls: Sequence[ToolCall],
        *,
        succeeded: bool,
        session_id: str | None = None,
    ) -> MemoryRecord | None:
        """Keep a successful run (task + tool calls that worked) for experience replay.

        Failed runs are not stored (returns None): replaying them would teach failure.
        """
        if not succeeded or not tool_calls:
            return None
        calls = [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in tool_calls]
        rendered = "\n".join(f"- {c.name}({c.arguments})" for c in tool_calls)
        return self.add(
            f"Task: {task}\nTool calls that worked:\n{rendered}",
            scope=scope,
            kind="episodic",
            type=RUN_TYPE,
            provenance="verified",
            verified_by="keel.runtime",
            session_id=session_id,
            metadata={"task": task, "tool_calls": calls},
        )

    def forget(self, scope: Scope, record_id: str) -> bool:
        """Delete one record of ``scope``; True if it existed."""
        return self.store.delete(scope, record_id)

    # --- outbox (the indexer) -------------------------------------------------------------

    def process_outbox(self, *, max_batches: int | None = None) -> int:
        """Embed and index what the outbox holds; returns how many records were embedded
        (see `OutboxIndexer.process`)."""
        return self.indexer.process(max_batches=max_batches)

    def index_pending(self, scope: Scope) -> int:
        """Embed and index ``scope``'s records still waiting in the outbox, now; returns how
        many (see `OutboxIndexer.index_pending`)."""
        return self.indexer.index_pending(scope)

    def pending(self) -> int:
        """Records waiting to be embedded (retries exhausted not counted)."""
        return self.indexer.pending()

    def start(self) -> None:
        """Start the background embedding worker (idempotent)."""
        self.indexer.start()

    def flush(self, timeout: float | None = 60.0) -> None:
        """Block until everything added so far is embedded (see `OutboxIndexer.flush`)."""
        self.indexer.flush(timeout)

    async def aflush(self, timeout: float | None = 60.0) -> None:
        """Async twin of [`flush`][]."""
        await run_blocking(self.indexer.flush, timeout)

    def close(self) -> None:
        """Stop the worker (work left stays in the durable outbox) and close the store."""
        self.indexer.stop()
        self.store.close()

    def __enter__(self) -> Memory:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def embedding_status(self) -> EmbeddingStatus:
        """Stored models against the configured one (detects a model change)."""
        return self.indexer.status()

    def reembed(self, progress: Callable[[int, int], object] | None = None) -> int:
        """Re-embed every record whose vector is missing or from another model.

        ``progress(done, total)`` is called after each batch. Returns the number embedded.
        """
        return self.indexer.reembed(progress)

    # --- facts and history ------------------------------------------------------------------

    def profile(self, scope: Scope, *, limit: int = 50) -> list[MemoryRecord]:
        """Current semantic facts and preferences of the user, newest first."""
        return self.retriever.profile(scope, limit=limit)

    def recent(
        self, scope: Scope, *, limit: int = 10, types: Sequence[str] = ()
    ) -> list[MemoryRecord]:
        """The last ``limit`` episodic records (optionally of some types), newest first."""
        return self.retriever.recent(scope, limit=limit, types=types)

    def fact_history(self, scope: Scope, subject: str, attribute: str) -> list[MemoryRecord]:
        """Every value of one fact, oldest first (superseded ones have ``valid_to`` set)."""
        view = self.view(scope)
        return self.store.fact_history(scope, view.mask(subject), view.mask(attribute))

    def get(self, scope: Scope, record_id: str) -> MemoryRecord | None:
        """One record of ``scope`` by id."""
        return self.store.get(scope, record_id)

    # --- search and retrieval (the retriever) -----------------------------------------------

    def search(
        self,
        query: str,
        *,
        scope: Scope,
        k: int = 10,
        filters: MemoryFilter | None = None,
        now: datetime | None = None,
        distinct: bool = True,
    ) -> list[MemoryHit]:
        """The ``k`` most relevant memories of ``scope`` for ``query``, with their context.

        ``distinct=False`` keeps near-duplicates (and skips MMR): for callers where two
        records holding the same text are still two answers, such as keyed records.
        """
        return self.retriever.search(query, scope, k, filters, now, distinct)

    async def asearch(self, query: str, *, scope: Scope, **options: Any) -> list[MemoryHit]:
        """Async twin of [`search`][]."""
        return await self._asearching(
            query, scope, lambda: self.search(query, scope=scope, **options)
        )

    def retrieve(
        self,
        query: str,
        *,
        scope: Scope,
        budget_tokens: int,
        k: int = 10,
        include_profile: bool = True,
        recent: int = 0,
        filters: MemoryFilter | None = None,
        now: datetime | None = None,
    ) -> PackedMemory:
        """Memories for a prompt, packed into exactly ``budget_tokens`` or fewer.

        Order of value: the user's current profile facts, then search hits by relevance
        (judged by the model judge in one call when configured), then the last ``recent``
        actions. Each block is labelled ``[kind · date · provenance]``.
        """
        judged = self.judge is not None
        draft = self.retriever.draft(
            query, scope, budget_tokens, k, include_profile, recent, filters, now, judged
        )
        judge = self.judge if draft.hits else None
        kept = None if judge is None else run_sync(judge.ajudge(query, draft.to_judge()))
        return draft.pack(kept, self.counter)

    async def aretrieve(
        self,
        query: str,
        *,
        scope: Scope,
        budget_tokens: int,
        k: int = 10,
        include_profile: bool = True,
        recent: int = 0,
        filters: MemoryFilter | None = None,
        now: datetime | None = None,
    ) -> PackedMemory:
        """Async twin of [`retrieve`][]."""
        judged = self.judge is not None
        draft = await self._asearching(
            query,
            scope,
            lambda: self.retriever.draft(
                query, scope, budget_tokens, k, include_profile, recent, filters, now, judged
            ),
        )
        judge = self.judge if draft.hits else None
        kept = None if judge is None else await judge.ajudge(query, draft.to_judge())
        return draft.pack(kept, self.counter)

    async def _asearching(self, query: str, scope: Scope, search: Callable[[], _T]) -> _T:
        """Run ``search`` (of ``query`` in ``scope``) for an event loop: on the loop's own
        thread where the store says a search of the scope costs a few milliseconds (the query
        embedded on the blocking pool first, unless that costs nothing), else on the pool.
        A turn's recall then costs no thread switch: on a busy machine each one waits for a
        CPU, and a turn made several (the search, its keyword query, the write after it)."""
        embedder = self.embedder if self.config.vector_weight > 0 else None
        if not self.store.searches_inline(scope, None if embedder is None else embedder.name):
            return await run_blocking(search)
        if embedder is not None and not embedder.cheap_queries:
            masked = mask_text(self.masker, query, scope.tenant_id)
            with contextlib.suppress(KeelError):  # the search says so, and goes on without it
                await run_blocking(embedder.embed_one, masked)
        return await self.store.acall(search)

    # --- experience replay ----------------------------------------------------------------

    def examples(
        self, task: str, *, scope: Scope, budget_tokens: int = 400, k: int = 3
    ) -> list[ReplayExample]:
        """Successful earlier runs similar to ``task``, within their own token budget."""
        replays = MemoryFilter(types=(RUN_TYPE,))
        hits = self.retriever.search(task, scope, k, replays, None, True)
        examples: list[ReplayExample] = []
        used = 0
        for hit in hits:
            meta = hit.record.metadata
            calls = tuple(
                ToolCall(
                    id=str(c.get("id") or f"call_{i}"),
                    name=str(c["name"]),
                    arguments=str(c.get("arguments", "{}")),
                )
                for i, c in enumerate(meta.get("tool_calls", []))
                if isinstance(c, dict) and "name" in c
            )
            example = ReplayExample(
                record_id=hit.record.id,
                task=str(meta.get("task", hit.record.text)),
                tool_calls=calls,
                score=hit.score,
            )
            tokens = self.counter.count_text(example.render())
            if used + tokens > budget_tokens:
                continue
            used += tokens
            examples.append(example)
        return examples

    def __repr__(self) -> str:
        return f"Memory({self.store!r}, embedder={self.embedder!r})"
