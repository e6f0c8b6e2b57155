from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from keel.errors import UsageError
from keel.memory import (
    HashingEmbedder,
    Memory,
    MemoryFilter,
    ModelJudge,
    RetrievalConfig,
    Scope,
    keyword_terms,
)
from keel.messages import ToolCall
from keel.stores import SQLiteDatabase, SQLiteMemoryStore
from keel.testing import ScriptedModel
from keel.tokens import counter_for

SCOPE = Scope(tenant_id="acme", user_id="u1")


@pytest.fixture
def memory(tmp_path: Path) -> Memory:
    mem = Memory(
        SQLiteMemoryStore(SQLiteDatabase(tmp_path / "m.db")), embedder=HashingEmbedder(128)
    )
    yield mem  # type: ignore[misc]
    mem.close()


def test_pii_is_masked_before_anything_is_persisted(memory: Memory, tmp_path: Path) -> None:
    record = memory.add(
        "my email is jane@example.com and card 4111 1111 1111 1111",
        scope=SCOPE,
        metadata={"contact": "call +1 415 555 0132"},
        session_id="s1",
    )
    memory.flush()
    assert record.text == "my email is <EMAIL_1> and card <CREDIT_CARD_1>"
    raw = sqlite3.connect(tmp_path / "m.db")
    dump = "\n".join(raw.iterdump())
    # Whole values, in every spelling: a fragment like "4111" also occurs in random ids.
    for secret in (
        "jane@example.com",
        "4111 1111 1111 1111",
        "4111111111111111",
        "+1 415 555 0132",
        "415 555 0132",
        "4155550132",
    ):
        assert secret not in dump, secret
    fts = raw.execute("SELECT text FROM memory_fts").fetchall()
    assert fts == [("my email is <EMAIL_1> and card <CREDIT_CARD_1>",)]
    # The vector is the embedding of the masked text, not of the original.
    vector = memory.store.vectors(SCOPE, [record.id], memory.embedder.name)[record.id]  # type: ignore[union-attr]
    assert float(vector @ memory.embedder.embed_one(record.text)) == pytest.approx(1.0, abs=1e-5)  # type: ignore[union-attr]
    assert memory.search("jane@example.com", scope=SCOPE)[0].record.id == record.id
    raw.close()


def test_masking_can_be_turned_off_explicitly(tmp_path: Path) -> None:
    mem = Memory(SQLiteMemoryStore(SQLiteDatabase(tmp_path / "x.db")), masker=None)
    assert mem.add("jane@example.com", scope=SCOPE).text == "jane@example.com"
    mem.close()


def test_user_claims_are_never_stored_as_verified(memory: Memory) -> None:
    with pytest.raises(UsageError, match="verified_by"):
        memory.add("I am a platinum member", scope=SCOPE, provenance="verified")
    claim = memory.add("I am a platinum member", scope=SCOPE, kind="semantic")
    assert claim.provenance == "user_claim" and claim.verified_by is None
    checked = memory.add(
        "membership tier: gold",
        scope=SCOPE,
        kind="semantic",
        provenance="verified",
        verified_by="crm.lookup",
    )
    assert checked.provenance == "verified" and checked.verified_by == "crm.lookup"
    with pytest.raises(UsageError):
        memory.add("   ", scope=SCOPE)
    with pytest.raises(UsageError):
        memory.add("x", scope=SCOPE, subject="u1")


def test_retrieve_packs_within_an_exact_budget_with_labels(memory: Memory) -> None:
    when = datetime(2024, 5, 7, tzinfo=UTC)
    memory.remember_fact(SCOPE, "user", "diet", "vegetarian", event_time=when)
    for number in range(30):
        memory.add(
            f"we discussed pasta recipe number {number} with tomatoes and basil",
            scope=SCOPE,
            type="turn",
            session_id="s",
            turn=number,
            event_time=when,
        )
    memory.flush()
    counter = counter_for("gpt-4o")
    for budget in (0, 15, 60, 200, 1000):
        packed = memory.retrieve("pasta recipe with basil", scope=SCOPE, budget_tokens=budget)
        assert packed.tokens == (counter.count_text(packed.text) if packed.text else 0)
        assert packed.tokens <= budget
    packed = memory.retrieve("pasta recipe with basil", scope=SCOPE, budget_tokens=200)
    assert packed.items[0].section == "profile"
    assert packed.items[0].text.startswith("[semantic · 2024-05-07 · user_claim] user diet")
    assert any(i.section == "relevant" for i in packed.items)
    assert "[episodic · 2024-05-07 · user_claim]" in packed.text
    assert packed.dropped > 0


def test_neighbouring_turns_come_with_a_hit(memory: Memory) -> None:
    texts = [
        "Where did you go last summer?",
        "We went to Kyoto and saw the temples.",
        "Nice! Did you like the food?",
        "The ramen was amazing.",
        "Totally unrelated turn.",
    ]
    records = [
        memory.add(t, scope=SCOPE, type="turn", session_id="s1", turn=i)
        for i, t in enumerate(texts)
    ]
    memory.flush()
    one_each_side = Memory(
        memory.store, embedder=memory.embedder, config=RetrievalConfig(wide_hits=0)
    )
    hits = one_each_side.search("Kyoto temples", scope=SCOPE, k=1)
    assert [r.id for r in hits[0].context] == [records[0].id, records[1].id, records[2].id]
    assert hits[0].record.id == records[1].id
    # By default the best hits show one more turn each side (``wide_hits``).
    wide = memory.search("Kyoto temples", scope=SCOPE, k=1)[0]
    assert wide.record.id == records[1].id
    assert [r.id for r in wide.context] == [r.id for r in records[:4]]
    narrow = Memory(memory.store, embedder=memory.embedder, config=RetrievalConfig(neighbours=0))
    only = narrow.search("Kyoto temples", scope=SCOPE, k=1)[0].records
    assert [r.id for r in only] == [records[1].id]


def test_near_duplicates_are_removed_and_mmr_diversifies(memory: Memory) -> None:
    a = memory.add("the red car is parked outside", scope=SCOPE)
    memory.add("The red car is parked outside!", scope=SCOPE)
    c = memory.add("the red bicycle is parked inside", scope=SCOPE)
    memory.flush()
    hits = memory.search("red car parked outside", scope=SCOPE, k=3)
    assert [h.record.id for h in hits][:1] == [a.id] or len(hits) == 2
    assert len(hits) == 2 and hits[1].record.id == c.id


def test_recency_breaks_ties_toward_recent_events(memory: Memory) -> None:
    now = datetime(2025, 1, 1, tzinfo=UTC)
    old = memory.add(
        "meeting notes about budget", scope=SCOPE, event_time=now - timedelta(days=400)
    )
    new = memory.add(
        "meeting notes about the budget", scope=SCOPE, event_time=now - timedelta(days=1)
    )
    memory.flush()
    cfg = RetrievalConfig(recency_weight=0.5, duplicate_similarity=1.01)
    recent_first = Memory(memory.store, embedder=memory.embedder, config=cfg)
    hits = recent_first.search("budget meeting", scope=SCOPE, k=2, now=now)
    assert [h.record.id for h in hits] == [new.id, old.id]
    # Each hit says what recency did to its score: 1 + 0.5 * 0.5 ** (age / 30 days).
    boosts = [h.recency_boost for h in hits]
    assert boosts == pytest.approx([1 + 0.5 * 0.5 ** (1 / 30), 1 + 0.5 * 0.5 ** (400 / 30)])


class _FetchCountingStore(SQLiteMemoryStore):
    """Counts the records a search reads back; ``lost`` ones vanish as if deleted meanwhile."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.fetched: list[str] = []
        self.lost: set[str] = set()

    def fetch(self, scope: Scope, record_ids: Sequence[str], filters: MemoryFilter) -> list[Any]:
        self.fetched.extend(record_ids)
        return [r for r in super().fetch(scope, record_ids, filters) if r.id not in self.lost]

    def fetch_by_id(
        self, scope: Scope, record_ids: Sequence[str], filters: MemoryFilter
    ) -> dict[str, Any]:
        self.fetched.extend(record_ids)
        found = super().fetch_by_id(scope, record_ids, filters)
        return {i: r for i, r in found.items() if i not in self.lost}


def _many_lantern_notes(
    tmp_path: Path, recency_weight: float
) -> tuple[Memory, _FetchCountingStore, datetime]:
    store = _FetchCountingStore(SQLiteDatabase(tmp_path / "count.db"))
    # duplicate_similarity > 1: notes differing only in their number are not dropped as repeats.
    cfg = RetrievalConfig(recency_weight=recency_weight, duplicate_similarity=1.01)
    memory = Memory(store, embedder=HashingEmbedder(128), config=cfg, masker=None)
    now = datetime(2025, 1, 1, tzinfo=UTC)
    words = ["harbour", "orchard", "granite", "meadow", "violin", "saffron", "copper", "willow"]
    for number in range(240):
        extra = " ".join(words[(number * step) % 8] for step in (1, 3, 5)[: 1 + number % 3])
        memory.add(
            f"lantern note {number} {extra}",
            scope=SCOPE,
            event_time=now - timedelta(days=number % 97),
        )
    memory.flush()
    return memory, store, now


@pytest.mark.parametrize("recency_weight", [0.05, 0.5])
def test_search_reads_back_only_records_that_can_rank(
    tmp_path: Path, recency_weight: float
) -> None:
    memory, store, now = _many_lantern_notes(tmp_path, recency_weight)
    query = "harbour granite meadow"
    reference = [h.record.id for h in memory.search(query, scope=SCOPE, k=60, now=now)]
    everything = len(set(store.fetched))
    store.fetched.clear()
    hits = memory.search(query, scope=SCOPE, k=5, now=now)
    assert [h.record.id for h in hits] == reference[:5]
    assert len(set(store.fetched)) < everything * (0.5 if recency_weight < 0.1 else 0.9)
    memory.close()


def test_records_that_vanish_before_read_back_are_replaced(tmp_path: Path) -> None:
    memory, store, now = _many_lantern_notes(tmp_path, 0.5)
    query = "harbour granite meadow"
    reference = [h.record.id for h in memory.search(query, scope=SCOPE, k=60, now=now)]
    store.lost = set(reference[:45])
    hits = memory.search(query, scope=SCOPE, k=5, now=now)
    assert [h.record.id for h in hits] == reference[45:50]
    memory.close()


def _thread_cpu_ticks() -> dict[str, int]:
    """CPU time (clock ticks) each thread of this process has used, by thread id."""
    ticks: dict[str, int] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        ticks[task.name] = int(fields[11]) + int(fields[12])
    return ticks


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="per-thread CPU needs /proc")
def test_search_leaves_no_thread_spinning_between_queries(tmp_path: Path) -> None:
    # OpenBLAS workers spin after each product numpy hands them; a search every few tens of
    # milliseconds kept one busy all the time (a whole core on a 2-core machine).
    memory = Memory(
        SQLiteMemoryStore(SQLiteDatabase(tmp_path / "spin.db")),
        embedder=HashingEmbedder(384),
        masker=None,
    )
    words = ["harbour", "orchard", "granite", "meadow", "violin", "saffron", "copper", "willow"]
    for number in range(2500):
        memory.add(f"note {number} {words[number % 8]} {words[number * 3 % 8]}", scope=SCOPE)
    memory.flush()
    for _ in range(3):
        memory.search("harbour granite", scope=SCOPE)
    main = str(threading.get_native_id())
    before = _thread_cpu_ticks()
    started = time.perf_counter()
    for number in range(30):
        memory.search(f"{words[number % 8]} meadow", scope=SCOPE)
        time.sleep(0.02)
    elapsed = time.perf_counter() - started
    after = _thread_cpu_ticks()
    others = sum(used - before.get(tid, 0) for tid, used in after.items() if tid != main)
    others_seconds = others / os.sysconf("SC_CLK_TCK")
    assert others_seconds < 0.25 * elapsed, f"{others_seconds:.2f} s CPU in {elapsed:.2f} s"
    memory.close()


async def test_model_judge_is_one_batched_call(memory: Memory) -> None:
    ids = [
        memory.add(t, scope=SCOPE).id
        for t in ("flight to Oslo on Monday", "flight seat preference aisle", "flight meal vegan")
    ]
    memory.flush()
    model = ScriptedModel(['{"relevant": [2]}'])
    judged = Memory(memory.store, embedder=memory.embedder, judge=ModelJudge(model))
    packed = await judged.aretrieve(
        "flight seat", scope=SCOPE, budget_tokens=500, include_profile=False
    )
    assert len(model.calls) == 1
    prompt = model.calls[0].last_user_text
    assert prompt.count("flight") >= 3
    kept = [rid for item in packed.items for rid in item.record_ids]
    assert len(kept) == 1 and kept[0] in ids
    broken = Memory(
        memory.store, embedder=memory.embedder, judge=ModelJudge(ScriptedModel(["nope"]))
    )
    everything = await broken.aretrieve(
        "flight", scope=SCOPE, budget_tokens=500, include_profile=False
    )
    assert len(everything.items) == 3


def test_experience_replay_under_its_own_budget(memory: Memory) -> None:
    calls = [
        ToolCall(id="c1", name="search_flights", arguments='{"to": "OSL"}'),
        ToolCall(id="c2", name="book_flight", arguments='{"flight": "SK123"}'),
    ]
    run = memory.remember_run(SCOPE, "book a flight to Oslo", calls, succeeded=True)
    assert run is not None and run.type == "run"
    assert memory.remember_run(SCOPE, "book a hotel", calls, succeeded=False) is None
    memory.remember_run(
        SCOPE,
        "cancel my hotel booking",
        [ToolCall(id="c3", name="cancel_hotel", arguments="{}")],
        succeeded=True,
    )
    memory.add("I like flights with a window seat", scope=SCOPE)
    memory.flush()
    examples = memory.examples("please book me a flight to Bergen", scope=SCOPE, budget_tokens=400)
    assert examples[0].task == "book a flight to Oslo"
    assert [c.name for c in examples[0].tool_calls] == ["search_flights", "book_flight"]
    assert "search_flights" in examples[0].render()
    assert memory.examples("book a flight", scope=SCOPE, budget_tokens=5) == []
    # Runs stay out of ordinary retrieval; they have their own budget.
    assert all(h.record.type != "run" for h in memory.search("book flight", scope=SCOPE))


def test_background_worker_embeds_off_the_hot_path(tmp_path: Path) -> None:
    class SlowEmbedder(HashingEmbedder):
        def __init__(self) -> None:
            super().__init__(32)
            self.gate = threading.Event()

        def embed(self, texts):  # type: ignore[no-untyped-def,override]
            self.gate.wait(5)
            return super().embed(texts)

    embedder = SlowEmbedder()
    mem = Memory(
        SQLiteMemoryStore(SQLiteDatabase(tmp_path / "bg.db")), embedder=embedder, background=True
    )
    record = mem.add("the wifi password is on the fridge", scope=SCOPE)  # returns at once
    assert mem.get(SCOPE, record.id) is not None
    assert mem.embedding_status().missing == 1
    embedder.gate.set()
    mem.flush(timeout=10)
    assert mem.embedding_status().counts == {"keel-hashing-32": 1}
    mem.close()


def test_embedding_model_change_is_detected(tmp_path: Path) -> None:
    store = SQLiteMemoryStore(SQLiteDatabase(tmp_path / "e.db"))
    first = Memory(store, embedder=HashingEmbedder(64))
    first.add("alpha beta", scope=SCOPE)
    first.flush()
    second = Memory(store, embedder=HashingEmbedder(96))
    status = second.embedding_status()
    assert status.needs_reembed and status.stale == 1
    progress: list[tuple[int, int]] = []
    assert second.reembed(progress=lambda done, total: progress.append((done, total))) == 1
    assert progress == [(1, 1)]
    assert not second.embedding_status().needs_reembed
    store.close()


def test_keyword_terms_are_safe_words() -> None:
    assert keyword_terms("What did Caroline do in May?") == ["caroline", "may"]
    assert keyword_terms('" OR 1=1 -- NEAR(x) *') == ["near"]
    assert all(t.isalnum() for t in keyword_terms("a'b\"c;d--e* f:g"))


def test_superseded_facts_hidden_unless_asked(memory: Memory) -> None:
    memory.remember_fact(SCOPE, "user", "city", "Lisbon")
    memory.remember_fact(SCOPE, "user", "city", "Porto")
    memory.flush()
    texts = [h.record.text for h in memory.search("user city", scope=SCOPE)]
    assert texts == ["user city: Porto"]
    history = MemoryFilter(include_superseded=True)
    assert len(memory.search("user city", scope=SCOPE, filters=history)) == 2


def test_failed_embeddings_are_retried_not_lost(tmp_path: Path) -> None:
    class Flaky(HashingEmbedder):
        down = True

        def embed(self, texts):  # type: ignore[no-untyped-def,override]
            if self.down:
                from keel.errors import ModelUnavailableError

                raise ModelUnavailableError("embedding server down")
            return super().embed(texts)

    embedder = Flaky(32)
    mem = Memory(
        SQLiteMemoryStore(SQLiteDatabase(tmp_path / "f.db")), embedder=embedder, max_attempts=2
    )
    record = mem.add("remember the milk", scope=SCOPE)
    assert mem.process_outbox() == 0 and mem.pending() == 1
    assert mem.process_outbox() == 0 and mem.pending() == 0  # attempts exhausted
    assert mem.last_error == "embedding server down"
    # Keyword search never depended on the embedder.
    assert mem.search("milk", scope=SCOPE)[0].record.id == record.id
    embedder.down = False
    assert mem.reembed() == 1
    assert mem.embedding_status().counts == {"keel-hashing-32": 1}
    mem.close()


def test_pending_is_one_count_in_the_store(tmp_path: Path) -> None:
    class NoLoading(SQLiteMemoryStore):
        def pending(self, limit: int, max_attempts: int = 5) -> Any:
            raise AssertionError("Memory.pending() must not read the outbox to count it")

    store = NoLoading(SQLiteDatabase(tmp_path / "count.db"))
    mem = Memory(store, embedder=HashingEmbedder(32))
    for number in range(3):
        mem.add(f"note {number}", scope=SCOPE)
    statements: list[str] = []
    store.db.connection().set_trace_callback(statements.append)
    try:
        assert mem.pending() == 3
    finally:
        store.db.connection().set_trace_callback(None)
    assert len(statements) == 1 and statements[0].startswith("SELECT COUNT(*) FROM memory_outbox")
    mem.close()


class _RecordingCondition(threading.Condition):
    """A condition that notes, per thread, whether each ``wait_for`` ended by its predicate."""

    def __init__(self) -> None:
        super().__init__()
        self.results: dict[str, list[bool]] = {}
        self.waiting: dict[str, threading.Event] = {}

    def wait_for(self, predicate: Any, timeout: float | None = None) -> Any:
        name = threading.current_thread().name
        self.waiting.setdefault(name, threading.Event()).set()
        result = super().wait_for(predicate, timeout)
        self.results.setdefault(name, []).append(bool(result))
        return result


class _GatedEmbedder(HashingEmbedder):
    def __init__(self) -> None:
        super().__init__(32)
        self.gate = threading.Event()

    def embed(self, texts):  # type: ignore[no-untyped-def,override]
        assert self.gate.wait(30), "test gate never opened"
        return super().embed(texts)


def _recorded_worker(tmp_path: Path, embedder: HashingEmbedder) -> tuple[Memory, Any]:
    mem = Memory(SQLiteMemoryStore(SQLiteDatabase(tmp_path / "w.db")), embedder=embedder)
    signal = _RecordingCondition()
    mem.indexer._signal = signal
    mem.start()
    return mem, signal


def test_flush_wakes_on_the_workers_signal(tmp_path: Path, monkeypatch: Any) -> None:
    # A re-check far beyond the flush timeout: flush can only return by the worker's signal.
    monkeypatch.setattr("keel.memory._outbox.FLUSH_RECHECK_S", 3600.0)
    embedder = _GatedEmbedder()
    mem, signal = _recorded_worker(tmp_path, embedder)
    mem.add("the spare key is in the shed", scope=SCOPE)
    errors: list[BaseException] = []

    def flush() -> None:
        try:
            mem.flush(timeout=20)
        except BaseException as exc:
            errors.append(exc)

    flusher = threading.Thread(target=flush, name="flusher", daemon=True)
    flusher.start()
    try:
        waited = signal.waiting.setdefault("flusher", threading.Event()).wait(20)
    finally:
        embedder.gate.set()
    assert waited, "flush never waited on the worker's signal"
    flusher.join(30)
    assert not flusher.is_alive() and errors == []
    assert mem.pending() == 0
    # Every wait of flush ended because the worker signalled, none by running out of time.
    assert signal.results["flusher"] and all(signal.results["flusher"])
    mem.close()


def test_add_wakes_the_worker(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setattr("keel.memory._outbox.WORKER_POLL_S", 3600.0)
    embedder = _GatedEmbedder()
    embedder.gate.set()
    mem, signal = _recorded_worker(tmp_path, embedder)
    with signal:  # the first pass (over an empty outbox) is over: the worker sleeps
        assert signal.wait_for(lambda: mem.indexer._progress >= 1, timeout=20)
    mem.add("the boiler code is written inside the cupboard", scope=SCOPE)  # no flush
    with signal:
        assert signal.wait_for(lambda: mem.store.count_pending() == 0, timeout=20)
    assert mem.embedding_status().counts == {"keel-hashing-32": 1}
    mem.close()


def test_flush_picks_up_another_processs_rows(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setattr("keel.memory._outbox.FLUSH_RECHECK_S", 3600.0)
    monkeypatch.setattr("keel.memory._outbox.WORKER_POLL_S", 3600.0)
    here = Memory(
        SQLiteMemoryStore(SQLiteDatabase(tmp_path / "shared.db")), embedder=HashingEmbedder(32)
    )
    here.start()
    with here.indexer._signal:  # its first pass is over: the worker sleeps until something wakes it
        assert here.indexer._signal.wait_for(lambda: here.indexer._progress >= 1, timeout=20)
    # The other process only writes (no worker): its add cannot signal this process.
    there = Memory(
        SQLiteMemoryStore(SQLiteDatabase(tmp_path / "shared.db")), embedder=HashingEmbedder(32)
    )
    there.add("written by the other process", scope=SCOPE)
    here.flush(timeout=20)
    assert here.pending() == 0 and there.pending() == 0
    assert here.embedding_status().counts == {"keel-hashing-32": 1}
    there.close()
    here.close()


class _RecordingEmbedder(HashingEmbedder):
    """Hashed vectors, and every text it was asked to embed."""

    def __init__(self) -> None:
        super().__init__(64)
        self.texts: list[str] = []

    def embed(self, texts: Sequence[str]) -> Any:
        self.texts.extend(texts)
        return super().embed(texts)


def test_a_turn_is_embedded_after_itself_with_the_turn_before_it_in_its_own_session(
    tmp_path: Path,
) -> None:
    store = SQLiteMemoryStore(SQLiteDatabase(tmp_path / "context.db"))
    embedder = _RecordingEmbedder()
    memory = Memory(store, embedder=embedder, masker=None)
    other_user = Scope(tenant_id="acme", user_id="u2")
    memory.add("Did you see the planetarium?", scope=SCOPE, session_id="s", turn=0)
    # The same session id and turn in another user's scope: never their context.
    memory.add("Secret plans of someone else", scope=other_user, session_id="s", turn=1)
    memory.add("An unrelated talk", scope=SCOPE, session_id="elsewhere", turn=1)
    memory.add("Yes, twice last spring.", scope=SCOPE, session_id="s", turn=1)
    memory.add("A note outside any session", scope=SCOPE)
    memory.process_outbox()
    memory.add("It was closed in winter.", scope=SCOPE, session_id="s", turn=2)
    memory.process_outbox()
    assert embedder.texts == [
        "Did you see the planetarium?",  # the session's first turn
        "Secret plans of someone else",  # u2's session "s" has no turn 0
        "An unrelated talk",
        "Yes, twice last spring.\nDid you see the planetarium?",
        "A note outside any session",
        "It was closed in winter.\nYes, twice last spring.",  # one turn back, the newest
    ]
    stored = store.vectors(SCOPE, [r.id for r in memory.recent(SCOPE, limit=1)], embedder.name)
    assert np.allclose(
        next(iter(stored.values())),
        embedder.embed_one("It was closed in winter.\nYes, twice last spring."),
    )
    embedder.texts.clear()
    alone = Memory(store, embedder=embedder, masker=None, config=RetrievalConfig(context_turns=0))
    alone.add("And the aquarium?", scope=SCOPE, session_id="s", turn=3)
    alone.process_outbox()
    assert embedder.texts == ["And the aquarium?"]
    memory.close()
    alone.close()


class _StepEmbedder(HashingEmbedder):
    """Records each batch it embeds, and forces the overlap the test expects: batch k + 1 is
    embedded only once write k has started (a write waiting on ``steps`` sees the next batch)."""

    def __init__(self, log: list[str]) -> None:
        super().__init__(32)
        self.log = log
        self.steps = threading.Condition()
        self.batches = 0
        self.writes_started = 0

    def embed(self, texts: Sequence[str]) -> Any:
        with self.steps:
            # Generous: only a pipeline that never overlaps (the defect) waits this long.
            self.steps.wait_for(lambda: self.writes_started >= self.batches, timeout=60)
        vectors = super().embed(texts)
        with self.steps:
            self.batches += 1
            self.log.append(f"embed {self.batches}")
            self.steps.notify_all()
        return vectors


def test_a_batch_is_written_while_the_next_is_embedded(tmp_path: Path) -> None:
    log: list[str] = []
    embedder = _StepEmbedder(log)
    store = SQLiteMemoryStore(SQLiteDatabase(tmp_path / "m.db"))
    complete = store.complete
    batches = 3  # 12 notes, 4 a batch

    def slow_complete(entries: Any, vectors: Any, model: str) -> None:
        with embedder.steps:
            embedder.writes_started += 1
            write = embedder.writes_started
            log.append(f"write {write} starts")
            embedder.steps.notify_all()
            if write < batches:  # the next batch's embedding runs meanwhile
                embedder.steps.wait_for(lambda: embedder.batches > write, timeout=60)
        complete(entries, vectors, model)
        log.append(f"write {write} ends")

    store.complete = slow_complete  # type: ignore[method-assign]
    memory = Memory(store, embedder=embedder, batch_size=4)
    for number in range(12):
        memory.add(f"note {number} about the harbour", scope=SCOPE)
    assert memory.process_outbox() == 12
    # Everything written when process_outbox returns, each write overlapping the next embed.
    assert memory.pending() == 0
    assert log == [
        "embed 1",
        "write 1 starts",
        "embed 2",
        "write 1 ends",
        "write 2 starts",
        "embed 3",
        "write 2 ends",
        "write 3 starts",
        "write 3 ends",
    ]
    assert len(memory.search("harbour", scope=SCOPE, k=20, distinct=False)) == 12
    memory.close()


def test_a_failed_write_is_raised_and_its_batch_stays_pending(tmp_path: Path) -> None:
    store = SQLiteMemoryStore(SQLiteDatabase(tmp_path / "m.db"))
    complete = store.complete
    calls = 0

    def failing_second(entries: Any, vectors: Any, model: str) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise sqlite3.OperationalError("disk I/O error")
        complete(entries, vectors, model)

    store.complete = failing_second  # type: ignore[method-assign]
    memory = Memory(store, embedder=HashingEmbedder(32), batch_size=4)
    for number in range(12):
        memory.add(f"note {number} about the lantern", scope=SCOPE)
    with pytest.raises(sqlite3.OperationalError):
        memory.process_outbox()
    # The first batch committed; the failed one (and the one embedded after it) wait.
    assert memory.pending() == 8
    assert memory.process_outbox() == 8
    assert memory.pending() == 0
    memory.close()


def _reads_noted(store: SQLiteMemoryStore) -> list[str]:
    """The name of the thread each read of ``store`` a retrieval makes ran on."""
    read_on: list[str] = []
    for name in ("fetch", "list_records", "keyword_search"):
        method = getattr(store, name)

        def noted(*args: Any, _method: Any = method, **kwargs: Any) -> Any:
            read_on.append(threading.current_thread().name)
            return _method(*args, **kwargs)

        setattr(store, name, noted)
    return read_on


def _harbour_memory(tmp_path: Path, judge: ModelJudge | None = None) -> tuple[Memory, list[str]]:
    store = SQLiteMemoryStore(SQLiteDatabase(tmp_path / "threads.db"))
    read_on = _reads_noted(store)
    memory = Memory(store, masker=None, judge=judge)  # keyword only: no overlap to fork
    memory.add("the harbour lantern is green", scope=SCOPE, kind="semantic")
    memory.add("we walked to the harbour at dawn", scope=SCOPE)
    return memory, read_on


def test_retrieve_reads_in_the_calling_thread_and_asks_the_judge_once(tmp_path: Path) -> None:
    model = ScriptedModel(['{"relevant": [1]}'])
    memory, read_on = _harbour_memory(tmp_path, ModelJudge(model))
    packed = memory.retrieve("harbour", scope=SCOPE, budget_tokens=300, recent=2)
    assert "harbour" in packed.text and len(model.calls) == 1
    # One path: the store is read right here, not through the bridge loop and back to a
    # thread (only the judge, a model call, runs on the bridge).
    assert read_on and set(read_on) == {threading.current_thread().name}
    memory.close()


async def test_aretrieve_reads_in_one_call_on_the_blocking_pool(tmp_path: Path) -> None:
    memory, read_on = _harbour_memory(tmp_path)
    packed = await memory.aretrieve("harbour", scope=SCOPE, budget_tokens=300, recent=2)
    assert "harbour" in packed.text
    # Profile, search and recent actions: every read in one hop off the event loop.
    assert len(read_on) >= 3 and len(set(read_on)) == 1
    assert read_on[0].startswith("keel-blocking")
    memory.close()


def test_memory_overlaps_its_work_on_keels_blocking_pool_only(tmp_path: Path) -> None:
    memory = Memory(
        SQLiteMemoryStore(SQLiteDatabase(tmp_path / "pool.db")), embedder=HashingEmbedder(32)
    )
    before = {thread.name for thread in threading.enumerate()}
    for number in range(10):
        memory.add(f"note {number} about the harbour", scope=SCOPE)
    assert memory.process_outbox() == 10  # batches written while the next is embedded
    assert memory.search("harbour", scope=SCOPE)  # keyword query beside the vector scan
    started = {thread.name for thread in threading.enumerate()} - before
    # No pool of its own: what runs beside the caller runs on the bridge's pool.
    assert all(name.startswith("keel-blocking") for name in started), started
    memory.close()
