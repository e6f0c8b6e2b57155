"""Memory: the long-term tiers of an agent, behind one object.

Write path: ``add`` masks PII, then commits the row and an outbox entry in one transaction and
returns; a background thread (or ``process_outbox`` / ``flush``) embeds and indexes the vector
later, so a crash between the two is repaired by processing the outbox on the next start.

Read path: exact look-ups (profile facts, recent actions), then keyword + vector candidates
fused by weighted reciprocal rank, a calibrated similarity floor, recency weighting,
de-duplication / MMR, neighbouring turns, an optional one-call model judge, and packing into an
exact token budget.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime
from functools import partial
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from keel._bridge import run_sync
from keel.errors import KeelError, UsageError
from keel.memory._config import RetrievalConfig
from keel.memory._embedders import Embedder
from keel.memory._judge import ModelJudge
from keel.memory._packing import PackedMemory, label_for, pack_items
from keel.memory._records import (
    MemoryFilter,
    MemoryKind,
    MemoryRecord,
    Provenance,
    Scope,
    content_hash,
    utcnow,
)
from keel.memory._similarity import gram
from keel.memory._store import MemoryStore, OutboxEntry, ScoredId
from keel.memory._text import keyword_terms, word_set
from keel.messages import ToolCall
from keel.privacy import PIIMasker
from keel.tokens import ChatTokenCounter, counter_for

__all__ = ["EmbeddingStatus", "Memory", "MemoryHit", "ReplayExample"]

logger = logging.getLogger("keel.memory")

RUN_TYPE = "run"

WORKER_POLL_S = 1.0
"""How long the background worker sleeps without a signal before it looks at the outbox again:
the only way it sees rows another process wrote (this process's adds wake it at once)."""

FLUSH_RECHECK_S = 1.0
"""How long ``flush`` waits for the worker's signal before it counts the outbox again (a bound
for the cases no signal reaches it, such as another process's worker draining the rows)."""


class MemoryHit(BaseModel):
    """One search result: the record, how it ranked, and the turns around it."""

    model_config = ConfigDict(frozen=True)

    record: MemoryRecord = Field(description="The matching record.")
    score: float = Field(description="Fused relevance score (higher is better).")
    keyword_rank: int | None = Field(default=None, description="1-based rank in keyword search.")
    vector_rank: int | None = Field(default=None, description="1-based rank in vector search.")
    similarity: float | None = Field(default=None, description="Cosine similarity to the query.")
    recency_boost: float | None = Field(
        default=None,
        description="What recency multiplied the fused score by, in [1, 1 + recency_weight] "
        "(None when recency weighting is off).",
    )
    context: tuple[MemoryRecord, ...] = Field(
        default=(), description="The record with its neighbouring turns, in turn order."
    )

    @property
    def records(self) -> tuple[MemoryRecord, ...]:
        """The context when there is one, else just the record."""
        return self.context or (self.record,)

    def render(self) -> str:
        """The labelled block this hit becomes in a prompt."""
        records = self.records
        if len(records) == 1:
            return f"{label_for(self.record)} {self.record.text}"
        lines = [label_for(self.record)]
        lines.extend(record.text for record in records)
        return "\n".join(lines)


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


class EmbeddingStatus(BaseModel):
    """Which embedding models produced the stored vectors, against the configured one."""

    model_config = ConfigDict(frozen=True)

    configured: str | None = Field(description="The embedder's model name (None: no embedder).")
    counts: dict[str, int] = Field(description="Records per model ('' for not embedded yet).")

    @property
    def stale(self) -> int:
        """Records whose vector is from another model (``keel memory reembed`` fixes them)."""
        return sum(n for model, n in self.counts.items() if model and model != self.configured)

    @property
    def missing(self) -> int:
        """Records not embedded yet (waiting in the outbox)."""
        return self.counts.get("", 0)

    @property
    def needs_reembed(self) -> bool:
        """True when some vectors come from a different model than the configured one."""
        return self.stale > 0


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
        background: embed in a daemon thread (True) or only on ``process_outbox``/``flush``.

    Example:
        >>> store = SQLiteMemoryStore(SQLiteDatabase("memory.db"))
        >>> memory = Memory(store, embedder=default_embedder())
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
        masker: PIIMasker | None = PIIMasker(),  # noqa: B008  (immutable default policy)
        config: RetrievalConfig | None = None,
        token_model: str = "gpt-4o",
        judge: ModelJudge | None = None,
        background: bool = False,
        batch_size: int = 64,
        max_attempts: int = 5,
    ) -> None:
        self.store = store
        self.embedder = embedder
        self.masker = masker
        self.config = config or RetrievalConfig()
        self.counter: ChatTokenCounter = counter_for(token_model, allow_estimate=True)
        self.judge = judge
        self.batch_size = batch_size
        self.max_attempts = max_attempts
        self.store.setup()
        # One condition for both directions: ``add`` and ``flush`` bump ``_work`` to wake the
        # worker; the worker bumps ``_progress`` after each batch and each pass over the outbox,
        # which is what ``flush`` waits for.
        self._signal = threading.Condition()
        self._work = 0
        self._progress = 0
        self._stop = threading.Event()
        self._worker: threading.Thread | None = None
        self._process_lock = threading.Lock()
        self._keyword_pool: ThreadPoolExecutor | None = None
        self._write_pool: ThreadPoolExecutor | None = None
        self._pools_lock = threading.Lock()
        self.last_error: str | None = None
        if background:
            self.start()

    # --- write path ---------------------------------------------------------------------

    def _mask(self, text: str, tenant_id: str) -> str:
        return text if self.masker is None else self.masker.mask_text(text, tenant_id=tenant_id)

    def _mask_value(self, value: Any, tenant_id: str) -> Any:
        if isinstance(value, str):
            return self._mask(value, tenant_id)
        if isinstance(value, Mapping):
            return {str(k): self._mask_value(v, tenant_id) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self._mask_value(v, tenant_id) for v in value]
        return value

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

        PII is masked first. Adding identical content twice returns the first record.
        A semantic record with ``subject`` and ``attribute`` supersedes the current value (a
        value the fact had before holds again as a new record, from now on; the current value
        added again is returned as it is).
        A record added under ``key`` replaces the scope's record under that key (a key is an
        identifier, stored as given, like the scope's ids); ``expires_at`` makes it expire.

        Raises:
            UsageError: empty text, or ``provenance="verified"`` without ``verified_by``
                (a user's claim is never stored as verified).
        """
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
        tenant = scope.tenant_id
        masked = self._mask(text, tenant)
        subject_m = None if subject is None else self._mask(subject, tenant)
        attribute_m = None if attribute is None else self._mask(attribute, tenant)
        now = utcnow()
        record = MemoryRecord(
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
            metadata=self._mask_value(dict(metadata or {}), tenant),
            key=key,
            expires_at=expires_at,
        )
        result = self.store.insert(record)
        if result.created:
            self._notify_work()
        return result.record

    async def aadd(self, text: str, *, scope: Scope, **fields: Any) -> MemoryRecord:
        """Async twin of :meth:`add`."""
        return await asyncio.to_thread(lambda: self.add(text, scope=scope, **fields))

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

    # --- outbox -------------------------------------------------------------------------

    def process_outbox(self, *, max_batches: int | None = None) -> int:
        """Embed and index what the outbox holds; returns how many records were embedded.

        Safe to call from several threads (one processes at a time). Without an embedder the
        outbox is drained with nothing to do but mark entries done (keyword search still works).
        Each batch's vectors are written while the next batch is embedded: on PostgreSQL the
        HNSW insertions run in the server while the embedder computes, instead of after it.
        Every write has committed when this returns.
        """
        done = 0
        batches = 0
        with self._process_lock:
            writing: Future[int] | None = None
            in_flight: set[int] = set()
            try:
                while max_batches is None or batches < max_batches:
                    # The batch being written is still pending until its write commits.
                    entries = [
                        entry
                        for entry in self.store.pending(
                            self.batch_size + len(in_flight), self.max_attempts
                        )
                        if entry.id not in in_flight
                    ][: self.batch_size]
                    if not entries:
                        break
                    batches += 1
                    if self.embedder is None:
                        self.store.fail(entries, "no embedder configured")
                        self._notify_progress()
                        continue
                    try:
                        vectors = self.embedder.embed(self._embedding_texts(entries))
                    except KeelError as exc:
                        self.last_error = str(exc)
                        self.store.fail(entries, str(exc))
                        self._notify_progress()
                        logger.warning("memory embedding failed: %s", exc)
                        break
                    if writing is not None:
                        done += writing.result()
                    writing = self._writer().submit(
                        self._complete, entries, list(vectors), self.embedder.name
                    )
                    in_flight = {entry.id for entry in entries}
            finally:
                if writing is not None:
                    done += writing.result()
        return done

    def index_pending(self, scope: Scope) -> int:
        """Embed and index ``scope``'s records still waiting in the outbox, now; returns how
        many. A search right after a write then finds the new records by meaning too, not
        only by their words, while ``add`` still returns without waiting for a vector. Only
        the scope's own entries are embedded (not another user's backlog); an embedder that
        fails leaves them waiting, and the search keyword-only for them."""
        if self.embedder is None:
            return 0
        done = 0
        with self._process_lock:
            while entries := self.store.pending(self.batch_size, self.max_attempts, scope=scope):
                try:
                    vectors = self.embedder.embed(self._embedding_texts(entries))
                except KeelError as exc:
                    self.last_error = str(exc)
                    self.store.fail(entries, str(exc))
                    logger.warning("memory embedding failed: %s", exc)
                    break
                done += self._complete(entries, list(vectors), self.embedder.name)
        return done

    def _complete(self, entries: list[OutboxEntry], vectors: list[Any], model: str) -> int:
        self.store.complete(entries, vectors, model)
        self._notify_progress()
        return len(entries)

    def _writer(self) -> ThreadPoolExecutor:
        """The one thread that writes embedded batches, in order."""
        with self._pools_lock:
            if self._write_pool is None:
                self._write_pool = ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix="keel-memory-write"
                )
            return self._write_pool

    def _embedding_texts(self, entries: Sequence[OutboxEntry]) -> list[str]:
        """What each entry's vector is computed from: its text and, for a turn of a session,
        the ``context_turns`` turns before it, newest first (an embedder that truncates a long
        text cuts the oldest context, never the turn). A turn rarely stands alone, and the
        turns before it are already stored when it is written, so it is embedded once."""
        span = self.config.context_turns
        wanted: dict[tuple[str, str], set[tuple[str, int, int]]] = {}
        for entry in entries:
            if span and entry.session_id is not None and entry.turn is not None:
                key = (entry.tenant_id, entry.user_id)
                wanted.setdefault(key, set()).add(
                    (entry.session_id, entry.turn - span, entry.turn - 1)
                )
        earlier: dict[tuple[str, str, str, int], str] = {}
        for (tenant_id, user_id), spans in wanted.items():
            scope = Scope(tenant_id=tenant_id, user_id=user_id)
            for record in self.store.turns_around(scope, sorted(spans)):
                if record.session_id is not None and record.turn is not None:
                    earlier[(tenant_id, user_id, record.session_id, record.turn)] = record.text
        texts: list[str] = []
        for entry in entries:
            parts = [entry.text]
            if entry.session_id is not None and entry.turn is not None:
                for turn in range(entry.turn - 1, entry.turn - span - 1, -1):
                    text = earlier.get((entry.tenant_id, entry.user_id, entry.session_id, turn))
                    if text is not None:
                        parts.append(text)
            texts.append("\n".join(parts))
        return texts

    def pending(self) -> int:
        """Records waiting to be embedded (retries exhausted not counted), counted by the
        store in one query."""
        return self.store.count_pending(self.max_attempts)

    def _notify_work(self) -> None:
        """Wake the worker: there is work (or a flush, or a stop)."""
        with self._signal:
            self._work += 1
            self._signal.notify_all()

    def _woken(self, seen: int) -> bool:
        return self._work != seen or self._stop.is_set()

    def _progressed(self, seen: int) -> bool:
        return self._progress != seen

    def _notify_progress(self) -> None:
        """Wake ``flush``: a batch was processed, or a pass over the outbox ended."""
        with self._signal:
            self._progress += 1
            self._signal.notify_all()

    def start(self) -> None:
        """Start the background embedding thread (idempotent)."""
        if self._worker is not None and self._worker.is_alive():
            return
        self._stop.clear()
        self._worker = threading.Thread(target=self._run, name="keel-memory-outbox", daemon=True)
        self._worker.start()

    def _run(self) -> None:
        seen = -1  # the first pass runs at once: the outbox may hold work from a crash
        while not self._stop.is_set():
            with self._signal:
                self._signal.wait_for(partial(self._woken, seen), timeout=WORKER_POLL_S)
                seen = self._work
            if self._stop.is_set():
                break
            try:
                while self.process_outbox(max_batches=1):
                    if self._stop.is_set():
                        break
            except Exception as exc:  # the worker must outlive one bad batch
                self.last_error = str(exc)
                logger.exception("memory outbox worker failed")
                self._stop.wait(0.5)
            self._notify_progress()

    def flush(self, timeout: float | None = 60.0) -> None:
        """Block until everything added so far is embedded.

        With the background worker, waits on its signal (each batch it processes, each pass it
        ends) rather than polling; the wait is bounded by ``FLUSH_RECHECK_S`` so rows written by
        another process sharing the database are counted too.
        """
        if self._worker is None or not self._worker.is_alive():
            self.process_outbox()
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._signal:
                seen = self._progress  # read before counting: no signal can be missed
            if not self.pending():
                return
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise TimeoutError("memory outbox did not drain in time")
            wait = FLUSH_RECHECK_S if remaining is None else min(FLUSH_RECHECK_S, remaining)
            with self._signal:
                self._work += 1  # make sure the worker looks (another process's rows)
                self._signal.notify_all()
                self._signal.wait_for(partial(self._progressed, seen), timeout=wait)

    async def aflush(self, timeout: float | None = 60.0) -> None:
        """Async twin of :meth:`flush`."""
        await asyncio.to_thread(self.flush, timeout)

    def close(self) -> None:
        """Stop the worker (work left stays in the durable outbox) and close the store."""
        self._stop.set()
        self._notify_work()
        if self._worker is not None:
            self._worker.join(timeout=10)
            self._worker = None
        if self._keyword_pool is not None:
            self._keyword_pool.shutdown(wait=True)
            self._keyword_pool = None
        if self._write_pool is not None:
            self._write_pool.shutdown(wait=True)
            self._write_pool = None
        self.store.close()

    def __enter__(self) -> Memory:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- embeddings bookkeeping -------------------------------------------------------------

    def embedding_status(self) -> EmbeddingStatus:
        """Stored models against the configured one (detects a model change)."""
        return EmbeddingStatus(
            configured=None if self.embedder is None else self.embedder.name,
            counts=self.store.embedding_models(),
        )

    def reembed(self, progress: Any = None) -> int:
        """Re-embed every record whose vector is missing or from another model.

        ``progress(done, total)`` is called after each batch. Returns the number embedded.
        """
        if self.embedder is None:
            raise UsageError("reembed needs an embedder")
        total = self.store.enqueue_reembed(self.embedder.name) or self.pending()
        done = 0
        while True:
            count = self.process_outbox(max_batches=1)
            if count == 0:
                break
            done += count
            if progress is not None:
                progress(done, max(total, done))
        return done

    # --- exact tier -----------------------------------------------------------------------

    def profile(self, scope: Scope, *, limit: int = 50) -> list[MemoryRecord]:
        """Current semantic facts and preferences of the user, newest first."""
        return self.store.list_records(scope, MemoryFilter(kinds=("semantic",)), limit=limit)

    def recent(
        self, scope: Scope, *, limit: int = 10, types: Sequence[str] = ()
    ) -> list[MemoryRecord]:
        """The last ``limit`` episodic records (optionally of some types), newest first."""
        return self.store.list_records(
            scope,
            MemoryFilter(kinds=("episodic",), types=tuple(types), exclude_types=(RUN_TYPE,)),
            limit=limit,
        )

    def fact_history(self, scope: Scope, subject: str, attribute: str) -> list[MemoryRecord]:
        """Every value of one fact, oldest first (superseded ones have ``valid_to`` set)."""
        tenant = scope.tenant_id
        return self.store.fact_history(
            scope, self._mask(subject, tenant), self._mask(attribute, tenant)
        )

    def get(self, scope: Scope, record_id: str) -> MemoryRecord | None:
        """One record of ``scope`` by id."""
        return self.store.get(scope, record_id)

    # --- search -------------------------------------------------------------------------

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
        filters = filters or MemoryFilter(exclude_types=(RUN_TYPE,))
        # MMR picks the k hits from the best ``window`` candidates; only those are read back.
        window = max(k * 4, 40)
        ranked = self._rank(query, scope, filters, now=now, window=window)
        if not distinct:
            return self._finish(ranked[:k], scope, k)
        return self._finish(self._diversify(ranked[:window], scope, keep=k), scope, k)

    async def asearch(self, query: str, *, scope: Scope, **options: Any) -> list[MemoryHit]:
        """Async twin of :meth:`search`."""
        return await asyncio.to_thread(lambda: self.search(query, scope=scope, **options))

    def _rank(
        self,
        query: str,
        scope: Scope,
        filters: MemoryFilter,
        *,
        now: datetime | None,
        window: int,
    ) -> list[MemoryHit]:
        """Fused candidates, best first: at least the best ``window`` of them (when there are
        that many), each with its record."""
        cfg = self.config
        masked_query = self._mask(query, scope.tenant_id)
        keyword: list[ScoredId] = []
        pending_keyword: Future[list[ScoredId]] | None = None
        terms = keyword_terms(masked_query)
        use_vectors = self.embedder is not None and cfg.vector_weight > 0
        if terms and cfg.keyword_weight > 0:
            if use_vectors:
                # The keyword query runs while the query is embedded and the vectors scanned:
                # SQLite, ONNX Runtime and numpy all release the GIL, so the two overlap.
                pending_keyword = self._keyword_pool_executor().submit(
                    self.store.keyword_search, scope, terms, filters, cfg.candidates
                )
            else:
                keyword = self.store.keyword_search(scope, terms, filters, cfg.candidates)
        vector_hits: list[ScoredId] = []
        if self.embedder is not None and use_vectors:
            try:
                query_vector = self.embedder.embed_one(masked_query)
            except KeelError as exc:
                # A down embedding endpoint degrades search to keyword-only, never fails it.
                self.last_error = str(exc)
                logger.warning("query embedding failed, keyword search only: %s", exc)
            else:
                vector_hits = self.store.vector_search(
                    scope, query_vector, self.embedder.name, filters, cfg.candidates
                )
        if pending_keyword is not None:
            keyword = pending_keyword.result()
        scores: dict[str, float] = {}
        keyword_rank: dict[str, int] = {}
        vector_rank: dict[str, int] = {}
        similarity: dict[str, float] = {}
        for rank, hit in enumerate(keyword, start=1):
            keyword_rank[hit.record_id] = rank
            scores[hit.record_id] = cfg.keyword_weight / (cfg.rrf_k + rank)
        for rank, hit in enumerate(vector_hits, start=1):
            vector_rank[hit.record_id] = rank
            similarity[hit.record_id] = hit.score
            if hit.record_id not in keyword_rank and hit.score < cfg.min_similarity:
                continue
            scores[hit.record_id] = scores.get(hit.record_id, 0.0) + cfg.vector_weight / (
                cfg.rrf_k + rank
            )
        if not scores:
            return []
        records = self._fetch_reachable(scope, filters, scores, window)
        reference = now or utcnow()
        hits: list[MemoryHit] = []
        for record_id, record in records.items():
            score = scores[record_id]
            boost = None
            if cfg.recency_weight > 0:
                age_days = max(0.0, (reference - record.when).total_seconds() / 86400)
                boost = 1.0 + cfg.recency_weight * math.pow(
                    0.5, age_days / cfg.recency_half_life_days
                )
                score *= boost
            hits.append(
                MemoryHit(
                    record=record,
                    score=score,
                    keyword_rank=keyword_rank.get(record_id),
                    vector_rank=vector_rank.get(record_id),
                    similarity=similarity.get(record_id),
                    recency_boost=boost,
                )
            )
        hits.sort(key=lambda h: (-h.score, h.record.id))
        return hits

    def _fetch_reachable(
        self, scope: Scope, filters: MemoryFilter, scores: dict[str, float], window: int
    ) -> dict[str, MemoryRecord]:
        """The records of every candidate that can still finish in the best ``window``.

        Recency multiplies a fused score by a factor in [1, 1 + recency_weight], so the
        ``window``-th best fused score is a floor under the ``window``-th best final score and
        a candidate whose boosted score stays below it can never enter: its record is not read
        (about 40 records instead of 200). Candidates the store drops (a filter, a concurrent
        delete) are replaced from the rest.
        """
        ordered = sorted(scores, key=lambda record_id: (-scores[record_id], record_id))
        boost = 1.0 + self.config.recency_weight
        records: dict[str, MemoryRecord] = {}
        start = 0
        while start < len(ordered):
            missing = window - len(records)
            floor = scores[ordered[start + missing - 1]] if start + missing <= len(ordered) else 0
            end = start + max(missing, 1)
            while end < len(ordered) and scores[ordered[end]] * boost >= floor:
                end += 1
            records.update((r.id, r) for r in self.store.fetch(scope, ordered[start:end], filters))
            start = end
            if len(records) >= window:
                break
        return records

    def _keyword_pool_executor(self) -> ThreadPoolExecutor:
        with self._pools_lock:
            if self._keyword_pool is None:
                self._keyword_pool = ThreadPoolExecutor(
                    max_workers=2, thread_name_prefix="keel-memory-keyword"
                )
            return self._keyword_pool

    def _diversify(self, hits: list[MemoryHit], scope: Scope, keep: int) -> list[MemoryHit]:
        """``keep`` of ``hits`` without near-duplicates; with ``mmr_lambda`` < 1 picked by MMR."""
        cfg = self.config
        count = len(hits)
        if count <= 1:
            return hits
        ids = [h.record.id for h in hits]
        vectors: dict[str, Any] = {}
        if self.embedder is not None:
            vectors = self.store.vectors(scope, ids, self.embedder.name)
        if len(vectors) == count:
            matrix = np.stack([np.asarray(vectors[i], dtype=np.float32) for i in ids])
            similarity = gram(matrix)
        else:
            words = [word_set(h.record.text) for h in hits]
            similarity = np.zeros((count, count), dtype=np.float32)
            for a in range(count):
                for b in range(a + 1, count):
                    union = words[a] | words[b]
                    value = len(words[a] & words[b]) / len(union) if union else 0.0
                    similarity[a, b] = similarity[b, a] = value
        relevance = np.array([h.score for h in hits], dtype=np.float64)
        relevance = relevance / max(float(relevance.max()), 1e-12)
        alive = np.ones(count, dtype=bool)
        redundancy = np.zeros(count, dtype=np.float64)
        selected: list[int] = []
        while len(selected) < keep and alive.any():
            values = cfg.mmr_lambda * relevance - (1 - cfg.mmr_lambda) * redundancy
            values[~alive] = -np.inf
            chosen = int(np.argmax(values))
            selected.append(chosen)
            alive[chosen] = False
            # Near-duplicates of what was chosen are removed for good.
            alive &= similarity[chosen] < cfg.duplicate_similarity
            redundancy = np.maximum(redundancy, similarity[chosen])
        return [hits[i] for i in selected]

    def _finish(self, hits: list[MemoryHit], scope: Scope, k: int) -> list[MemoryHit]:
        """Top ``k`` hits with their neighbouring turns.

        A hit that an earlier hit already shows (as a neighbour) still counts as one of the
        ``k`` and extends that earlier block with its own neighbours, so adjacent hits become
        one contiguous block and no turn is shown twice.
        """
        span = self.config.neighbours
        owner: dict[str, int] = {}
        blocks: list[MemoryHit] = []
        # Every hit's neighbouring turns in one read (one query, not one per hit).
        around: dict[str, list[MemoryRecord]] = {}
        spans = {
            (hit.record.session_id, hit.record.turn - span, hit.record.turn + span)
            for hit in hits[:k]
            if span and hit.record.session_id is not None and hit.record.turn is not None
        }
        for found in self.store.turns_around(scope, sorted(spans)) if spans else ():
            around.setdefault(found.session_id or "", []).append(found)
        for hit in hits[:k]:
            record = hit.record
            turns: tuple[MemoryRecord, ...] = (record,)
            if span and record.session_id is not None and record.turn is not None:
                first, last = record.turn - span, record.turn + span
                turns = tuple(
                    r
                    for r in around.get(record.session_id, ())
                    if r.turn is not None and first <= r.turn <= last
                ) or (record,)
            if record.id in owner:
                index = owner[record.id]
                block = blocks[index]
                merged = {r.id: r for r in block.records}
                for turn in turns:
                    if turn.id not in owner:
                        merged[turn.id] = turn
                        owner[turn.id] = index
                ordered = sorted(merged.values(), key=lambda r: (r.turn or 0, r.created_at))
                blocks[index] = block.model_copy(update={"context": tuple(ordered)})
                continue
            fresh = tuple(r for r in turns if r.id not in owner or r.id == record.id)
            for turn in fresh:
                owner[turn.id] = len(blocks)
            blocks.append(hit.model_copy(update={"context": fresh if span else ()}))
        return blocks

    # --- retrieval for a prompt -----------------------------------------------------------

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
        return run_sync(
            self.aretrieve(
                query,
                scope=scope,
                budget_tokens=budget_tokens,
                k=k,
                include_profile=include_profile,
                recent=recent,
                filters=filters,
                now=now,
            )
        )

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
        """Async twin of :meth:`retrieve`."""
        if budget_tokens < 0:
            raise UsageError("budget_tokens must be >= 0")
        hits = await asyncio.to_thread(
            lambda: self.search(
                query,
                scope=scope,
                k=max(k, self.config.judge_candidates if self.judge else k),
                filters=filters,
                now=now,
            )
        )
        if self.judge is not None and hits:
            shown = hits[: self.config.judge_candidates]
            keep = await self.judge.ajudge(query, [h.render() for h in shown])
            hits = [shown[i] for i in keep]
        hits = hits[:k]
        candidates: list[tuple[str, str, tuple[str, ...], float]] = []
        if include_profile:
            facts = await asyncio.to_thread(self.profile, scope)
            candidates.extend(
                ("profile", f"{label_for(r)} {r.text}", (r.id,), math.inf) for r in facts
            )
        candidates.extend(
            ("relevant", h.render(), tuple(r.id for r in h.records), h.score) for h in hits
        )
        if recent:
            actions = await asyncio.to_thread(lambda: self.recent(scope, limit=recent))
            candidates.extend(("recent", f"{label_for(r)} {r.text}", (r.id,), 0.0) for r in actions)
        return pack_items(candidates, budget_tokens, self.counter)

    # --- experience replay ----------------------------------------------------------------

    def examples(
        self, task: str, *, scope: Scope, budget_tokens: int = 400, k: int = 3
    ) -> list[ReplayExample]:
        """Successful earlier runs similar to ``task``, within their own token budget."""
        hits = self.search(task, scope=scope, k=k, filters=MemoryFilter(types=(RUN_TYPE,)))
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
