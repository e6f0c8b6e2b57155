"""The outbox indexer: embeds and indexes what ``Memory.add`` committed, off the write path.

``add`` commits a record and an outbox entry in one transaction; this embeds the entries in
batches (in a background worker, or when ``process`` / ``flush`` is called) and writes their
vectors, so a crash between the two is repaired by processing the outbox on the next start.
The worker is a task on keel's bridge loop (`keel._bridge.spawn`) that runs each batch on the
blocking pool (`keel._bridge.run_blocking`): no thread of its own.

The worker gathers adds into batches: woken by an add, it waits until ``batch_size`` entries
are waiting or ``BATCH_WAIT_S`` has passed (a flush, a stop or ``notify_work()`` without an add
cuts the wait short). A turn's add then costs the worker nothing until a batch is due, and a
batch's fixed costs (the outbox read, the context read, the transaction, the embedder's call)
are paid once per batch instead of once per turn, away from the turns that wrote it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from functools import partial
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from keel._bridge import Forked, fork, on_bridge_thread, run_blocking, spawn
from keel.errors import KeelError, UsageError
from keel.memory._embedders import Embedder
from keel.memory._records import Scope
from keel.memory._store import MemoryStore, OutboxEntry

__all__ = ["EmbeddingStatus", "OutboxIndexer"]

logger = logging.getLogger("keel.memory")

WORKER_POLL_S = 1.0
"""How long the background worker sleeps without a signal before it looks at the outbox again:
the only way it sees rows another process wrote (this process's adds wake it at once)."""

BATCH_WAIT_S = 0.5
"""How long the background worker, woken by an add, waits for more adds before it embeds what
is waiting (unless a whole batch is waiting sooner, or a flush asks for it): until then a new
record is found by its words, not yet by its vector."""

FLUSH_RECHECK_S = 1.0
"""How long ``flush`` waits for the worker's signal before it counts the outbox again (a bound
for the cases no signal reaches it, such as another process's worker draining the rows)."""


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


class OutboxIndexer:
    """Embeds a memory store's outbox in batches and writes the vectors, in order.

    Args:
        store: the store whose outbox it drains.
        embedder: makes the vectors; None drains the outbox with nothing to embed.
        context_turns: turns before a session's turn embedded with it.
        batch_size: entries embedded at once.
        max_attempts: failed embeddings retried this often before an entry is left alone.
        on_error: told each embedding failure's message (``Memory.last_error``).
    """

    def __init__(
        self,
        store: MemoryStore,
        embedder: Embedder | None,
        *,
        context_turns: int,
        batch_size: int,
        max_attempts: int,
        on_error: Callable[[str], None],
    ) -> None:
        self.store = store
        self.embedder = embedder
        self.context_turns = context_turns
        self.batch_size = batch_size
        self.max_attempts = max_attempts
        self._on_error = on_error
        # One condition for both directions: ``add`` and ``flush`` bump ``_work`` to wake the
        # worker; the worker bumps ``_progress`` after each batch and each pass over the outbox,
        # which is what ``flush`` waits for.
        self._signal = threading.Condition()
        self._work = 0
        self._added = 0  # entries added (``notify_work(added=...)``), for gathering batches
        self._urgent = 0  # wakes that are not an add: a flush, a stop, an explicit call
        self._progress = 0
        self._stop = threading.Event()
        self._worker: Future[None] | None = None
        self._worker_pid = 0  # a forked child has none of its parent's bridge loop
        self._wake: asyncio.Event | None = None  # the worker's, on the bridge loop
        self._wake_loop: asyncio.AbstractEventLoop | None = None
        # ``_added`` when the worker began gathering a batch (None: it is not gathering).
        self._gathering_from: int | None = None
        self._process_lock = threading.Lock()

    def process(self, *, max_batches: int | None = None, by_length: bool = False) -> int:
        """Embed and index what the outbox holds; returns how many records were embedded.

        Safe to call from several threads (one processes at a time). Without an embedder the
        outbox is drained with nothing to do but mark entries done (keyword search still works).
        Each batch's vectors are written while the next batch is embedded: on PostgreSQL the
        HNSW insertions run in the server while the embedder computes, instead of after it.
        Writes run one at a time, in batch order, and every one has committed when this returns.
        """
        done = 0
        batches = 0
        with self._process_lock:
            writing: Forked[int] | None = None
            in_flight: set[int] = set()
            try:
                while max_batches is None or batches < max_batches:
                    entries = self._next_batch(in_flight)
                    if not entries:
                        break
                    batches += 1
                    vectors = self._embed(entries, by_length=by_length)
                    if vectors is None:
                        if self.embedder is not None:
                            break  # the embedder failed: the entries wait for a later pass
                        continue
                    if writing is not None:
                        done += writing.join()
                    writing = fork(self._complete, entries, vectors)
                    in_flight = {entry.id for entry in entries}
            finally:
                if writing is not None:
                    done += writing.join()
        return done

    def _next_batch(self, in_flight: set[int]) -> list[OutboxEntry]:
        """The next batch of pending entries; the batch being written is still pending until
        its write commits, so it is skipped."""
        pending = self.store.pending(self.batch_size + len(in_flight), self.max_attempts)
        return [entry for entry in pending if entry.id not in in_flight][: self.batch_size]

    def _embed(self, entries: list[OutboxEntry], *, by_length: bool = False) -> list[Any] | None:
        """The entries' vectors; None when there are none to write (no embedder, or it failed:
        the entries are marked failed and retried on a later pass). ``by_length``: texts of
        like lengths are embedded together (see `_by_length`)."""
        if self.embedder is None:
            self.store.fail(entries, "no embedder configured")
            self._notify_progress()
            return None
        try:
            texts = self._embedding_texts(entries)
            if by_length:
                return _by_length(self.embedder, texts)
            return list(self.embedder.embed(texts))
        except KeelError as exc:
            self._on_error(str(exc))
            self.store.fail(entries, str(exc))
            self._notify_progress()
            logger.warning("memory embedding failed: %s", exc)
            return None

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
                vectors = self._embed(entries)
                if vectors is None:
                    break
                done += self._complete(entries, vectors)
        return done

    def _complete(self, entries: list[OutboxEntry], vectors: list[Any]) -> int:
        assert self.embedder is not None  # only embedded batches are written
        self.store.complete(entries, vectors, self.embedder.name)
        self._notify_progress()
        return len(entries)

    def _embedding_texts(self, entries: Sequence[OutboxEntry]) -> list[str]:
        """What each entry's vector is computed from: its text and, for a turn of a session,
        the ``context_turns`` turns before it, newest first (an embedder that truncates a long
        text cuts the oldest context, never the turn). A turn rarely stands alone, and the
        turns before it are already stored when it is written, so it is embedded once."""
        span = self.context_turns
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

    def status(self) -> EmbeddingStatus:
        """Stored models against the configured one (detects a model change)."""
        return EmbeddingStatus(
            configured=None if self.embedder is None else self.embedder.name,
            counts=self.store.embedding_models(),
        )

    def reembed(self, progress: Callable[[int, int], object] | None = None) -> int:
        """Re-embed every record whose vector is missing or from another model; ``progress(done,
        total)`` is called after each batch. Returns the number embedded."""
        if self.embedder is None:
            raise UsageError("reembed needs an embedder")
        total = self.store.enqueue_reembed(self.embedder.name) or self.pending()
        done = 0
        while count := self.process(max_batches=1):
            done += count
            if progress is not None:
                progress(done, max(total, done))
        return done

    # --- the background worker and its signals ----------------------------------------------

    def notify_work(self, *, added: int = 0) -> None:
        """Wake the worker: ``added`` entries were added (the worker may wait for a batch), or,
        with none, there is work to do now (a flush, a stop)."""
        with self._signal:
            self._work += 1
            self._added += added
            if not added:
                self._urgent += 1
            self._signal.notify_all()
            # A worker gathering a batch waits for its deadline anyway: an add that does not
            # fill the batch would wake it (a switch to the bridge loop's thread, every turn)
            # only for it to wait again. What it did not see it finds on its next pass.
            gathering = self._gathering_from
            quiet = bool(added) and gathering is not None
            quiet = quiet and self._added - (gathering or 0) < self.batch_size
        if not quiet:
            self._wake_worker()

    def _wake_worker(self) -> None:
        wake, loop = self._wake, self._wake_loop
        if wake is not None and loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed: no worker to wake
                loop.call_soon_threadsafe(wake.set)

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
        """Start the background worker on the bridge loop (idempotent)."""
        if self._running():
            return
        self._stop.clear()
        self._worker_pid = os.getpid()
        self._worker = spawn(self._run())

    def _running(self) -> bool:
        worker = self._worker
        return worker is not None and not worker.done() and self._worker_pid == os.getpid()

    async def _run(self) -> None:
        wake = self._wake = asyncio.Event()
        self._wake_loop = asyncio.get_running_loop()
        # The first pass runs at once: the outbox may hold work from a crash.
        seen = urgent = added = -1
        while not self._stop.is_set():
            wake.clear()  # before reading ``_work``: a signal after this read sets it again
            if self._work == seen:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), WORKER_POLL_S)
            if self._urgent == urgent and self._added != added:
                await self._gather(wake, added, urgent)
            # Read before the pass: what is added during it wakes the next one.
            seen, urgent, added = self._work, self._urgent, self._added
            if self._stop.is_set():
                break
            try:
                while await run_blocking(self.process, max_batches=1, by_length=True):
                    if self._stop.is_set():
                        break
            except Exception as exc:  # the worker must outlive one bad batch
                self._on_error(str(exc))
                logger.exception("memory outbox worker failed")
                await asyncio.sleep(0.5)
            self._notify_progress()
        self._wake = self._wake_loop = None

    async def _gather(self, wake: asyncio.Event, added: int, urgent: int) -> None:
        """Woken by adds (``added`` and ``urgent`` counted at the last pass), wait until a
        whole batch is waiting or ``BATCH_WAIT_S`` has passed; a wake that is not an add (a
        flush, a stop) ends the wait at once."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + BATCH_WAIT_S
        with self._signal:  # under the lock an add reads it with; whoever waits re-checks
            self._gathering_from = added
            self._signal.notify_all()
        try:
            while self._added - added < self.batch_size:
                wake.clear()  # before the checks: a signal after them sets it again
                remaining = deadline - loop.time()
                if remaining <= 0 or self._urgent != urgent or self._stop.is_set():
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), remaining)
        finally:
            self._gathering_from = None

    def flush(self, timeout: float | None = 60.0) -> None:
        """Block until everything added so far is embedded.

        With the background worker, waits on its signal (each batch it processes, each pass it
        ends) rather than polling; the wait is bounded by ``FLUSH_RECHECK_S`` so rows written by
        another process sharing the database are counted too.
        """
        if not self._running():
            self.process()
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
            self.notify_work()  # make sure the worker looks (another process's rows)
            with self._signal:
                self._signal.wait_for(partial(self._progressed, seen), timeout=wait)

    def stop(self) -> None:
        """Stop the worker; the work left stays in the durable outbox."""
        self._stop.set()
        self.notify_work()
        worker, self._worker = self._worker, None
        # The batch in progress ends first (at most 10 s), unless this is the bridge loop's
        # own thread, which the worker needs to end: then it ends after this returns.
        if worker is not None and self._worker_pid == os.getpid() and not on_bridge_thread():
            with contextlib.suppress(Exception):
                worker.result(timeout=10)


def _by_length(embedder: Embedder, texts: list[str]) -> list[Any]:
    """``texts``' vectors, in order, embedded in groups of like lengths (a text at most twice
    the group's shortest, plus 64 characters). The worker's batches gather what turns wrote
    over a while, a long running summary among short turns: embedded at once, a transformer
    pads every text of a pass to the longest, and the short ones cost what the long one does
    (``keel demo``: 14% more CPU than embedding each turn's records as they came). An explicit
    ``process`` keeps one call per batch, so the vectors it writes stay as they were."""
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    groups: list[list[int]] = []
    for index in order:
        if groups and len(texts[index]) <= 2 * len(texts[groups[-1][0]]) + 64:
            groups[-1].append(index)
        else:
            groups.append([index])
    vectors: list[Any] = [None] * len(texts)
    for group in groups:
        for index, vector in zip(group, embedder.embed([texts[i] for i in group]), strict=True):
            vectors[index] = vector
    return vectors
