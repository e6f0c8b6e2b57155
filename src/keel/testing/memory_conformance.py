"""The conformance suite every [`keel.memory.MemoryStore`][] backend must pass.

Subclass `MemoryStoreConformance` in a test module and provide a ``make_store``
fixture: a callable that opens the backend (calling it twice in one test must open the SAME
database, as a restarted process would):

```python
class TestMyStore(MemoryStoreConformance):
    @pytest.fixture
    def make_store(self, tmp_path):
        database = SQLiteDatabase(tmp_path / "memory.db")
        return lambda: SQLiteMemoryStore(database)
```

The suite checks round trips, idempotent adds, facts superseded over time (and changed back to an
earlier value, as a new interval), the outbox, its count and its replay after a crash, keyword
search (BM25-like: rare words outweigh common ones) and vector search, filters (what a prompt
shows of its session left out in the query: searches still fill their limit), deletion,
re-embedding, tenant isolation against crafted queries, and write isolation: a write for one
(tenant, user) never touches another's records, neither when it supersedes a fact with the same
key, nor when it forgets a record by id, nor when a re-embed rewrites every vector. The other
scopes are a user of the same tenant and a user with the same user id in another tenant, so a
write that checks only one half of the scope fails.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable

import numpy as np

from keel.memory import HashingEmbedder, Memory, MemoryFilter, MemoryStore, Scope, ShownSession

__all__ = ["MemoryStoreConformance", "StoreFactory"]

StoreFactory = Callable[[], MemoryStore]

ALICE = Scope(tenant_id="acme", user_id="alice")
BOB = Scope(tenant_id="acme", user_id="bob")
EVE = Scope(tenant_id="evil-corp", user_id="alice")
OTHERS = (BOB, EVE)
"""ALICE's neighbours: same tenant, another user; another tenant, the same user id."""

INJECTIONS = (
    "' OR 1=1 --",
    '" OR tenant_id:* OR "',
    "alice) OR (user_id = 'bob'",
    "NEAR(secret bob) * ^",
    "secret%' UNION SELECT * FROM memory_records --",
    "text:secret OR {tenant_id user_id}:bob",
)


def _memory(store: MemoryStore, dimension: int = 64) -> Memory:
    return Memory(store, embedder=HashingEmbedder(dimension), masker=None)


class MemoryStoreConformance:
    """Behaviour every memory backend shares. Provide a ``make_store`` fixture."""

    def test_round_trip_keeps_every_field(self, make_store: StoreFactory) -> None:
        memory = _memory(make_store())
        record = memory.add(
            "Alice booked flight LH400 to Frankfurt",
            scope=ALICE,
            kind="episodic",
            type="turn",
            session_id="s1",
            step=3,
            turn=7,
            metadata={"source": "chat", "n": 2},
        )
        stored = memory.get(ALICE, record.id)
        assert stored is not None
        assert stored.model_dump(exclude={"embedding_model"}) == record.model_dump(
            exclude={"embedding_model"}
        )
        assert stored.embedding_model is None
        memory.close()

    def test_identical_add_is_idempotent(self, make_store: StoreFactory) -> None:
        memory = _memory(make_store())
        first = memory.add("prefers window seats", scope=ALICE, kind="semantic")
        second = memory.add("prefers  window seats", scope=ALICE, kind="semantic")
        assert second.id == first.id
        assert memory.store.count(ALICE) == 1
        other = memory.add("prefers window seats", scope=BOB, kind="semantic")
        assert other.id != first.id
        assert memory.store.count() == 2
        memory.close()

    def test_a_keyed_add_replaces_a_different_record_and_keeps_the_same_one(
        self, make_store: StoreFactory
    ) -> None:
        memory = _memory(make_store())
        first = memory.add("summary one", scope=ALICE, kind="episodic", key="k")
        again = memory.add("summary one", scope=ALICE, kind="episodic", key="k")
        assert again.id == first.id and memory.store.count(ALICE) == 1
        replaced = memory.add("summary two", scope=ALICE, kind="episodic", key="k")
        assert replaced.id != first.id and memory.store.count(ALICE) == 1
        assert memory.get(ALICE, first.id) is None
        memory.close()

    def test_fact_supersedes_and_keeps_history(self, make_store: StoreFactory) -> None:
        memory = _memory(make_store())
        old = memory.remember_fact(ALICE, "alice", "home city", "Lisbon")
        new = memory.remember_fact(ALICE, "alice", "home city", "Porto")
        again = memory.remember_fact(ALICE, "alice", "home city", "Porto")
        assert again.id == new.id
        history = memory.fact_history(ALICE, "alice", "home city")
        assert [r.metadata["value"] for r in history] == ["Lisbon", "Porto"]
        assert history[0].id == old.id and history[0].valid_to is not None
        assert history[1].valid_to is None
        current = memory.profile(ALICE)
        assert [r.id for r in current] == [new.id]
        everything = memory.store.list_records(ALICE, MemoryFilter(include_superseded=True))
        assert {r.id for r in everything} == {old.id, new.id}
        assert memory.fact_history(BOB, "alice", "home city") == []
        memory.close()

    def test_a_fact_can_change_back_as_a_new_validity_interval(
        self, make_store: StoreFactory
    ) -> None:
        """People move back: Paris, Lyon, then Paris again is three intervals, the last one
        current, and it is a new record (the first Paris keeps its own interval)."""
        memory = _memory(make_store())
        first = memory.remember_fact(ALICE, "alice", "home city", "Paris")
        moved = memory.remember_fact(ALICE, "alice", "home city", "Lyon")
        back = memory.remember_fact(ALICE, "alice", "home city", "Paris")
        again = memory.remember_fact(ALICE, "alice", "home city", "Paris")
        history = memory.fact_history(ALICE, "alice", "home city")
        assert [(r.metadata["value"], r.valid_to is None) for r in history] == [
            ("Paris", False),
            ("Lyon", False),
            ("Paris", True),
        ]
        assert [r.id for r in history] == [first.id, moved.id, back.id]
        assert back.id != first.id and again.id == back.id, "the current value is idempotent"
        assert history[0].valid_to == history[1].valid_from
        assert history[1].valid_to == history[2].valid_from
        assert [r.id for r in memory.profile(ALICE)] == [back.id]
        # It is a record of its own in every tier: the outbox embeds it, search finds it.
        memory.flush()
        hits = memory.search("home city Paris", scope=ALICE, k=5)
        assert back.id in {hit.record.id for hit in hits}
        assert memory.fact_history(BOB, "alice", "home city") == []
        memory.close()

    def test_concurrent_writers_of_a_fact_leave_one_current_value(
        self, make_store: StoreFactory
    ) -> None:
        """Each writer reads the current value and supersedes it: two at once, one store
        each (as two processes), must not both leave theirs current."""
        writers = 6
        memories = [_memory(make_store()) for _ in range(writers)]
        for round_ in range(3):
            scope = Scope(tenant_id="acme", user_id=f"racer-{round_}")
            memories[0].remember_fact(scope, "user", "home city", "Paris")
            start = threading.Barrier(writers)

            def write(index: int, scope: Scope = scope, start: threading.Barrier = start) -> None:
                start.wait(timeout=60)
                memories[index].remember_fact(scope, "user", "home city", f"city {index}")

            threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=120)
            history = memories[0].fact_history(scope, "user", "home city")
            assert len(history) == writers + 1
            assert [r.valid_to is None for r in history].count(True) == 1, history
        for memory in memories:
            memory.close()

    def test_outbox_is_replayed_after_a_crash(self, make_store: StoreFactory) -> None:
        first = _memory(make_store())
        record = first.add("the spare key is under the blue flowerpot", scope=ALICE)
        assert first.pending() == 1
        # The process dies here: nothing embedded yet, only the committed row + outbox entry.
        first.store.close()
        second = _memory(make_store())
        assert second.pending() == 1
        assert second.process_outbox() == 1
        assert second.pending() == 0
        vector = second.embedder.embed_one("blue flowerpot key")  # type: ignore[union-attr]
        hits = second.store.vector_search(ALICE, vector, "keel-hashing-64", MemoryFilter(), 5)
        assert [h.record_id for h in hits] == [record.id]
        stored = second.get(ALICE, record.id)
        assert stored is not None and stored.embedding_model == "keel-hashing-64"
        second.close()

    def test_pending_entries_are_counted_by_the_store(self, make_store: StoreFactory) -> None:
        store = make_store()
        memory = Memory(
            store, embedder=HashingEmbedder(64), masker=None, batch_size=2, max_attempts=2
        )
        for number, scope in enumerate((ALICE, BOB, EVE, ALICE, BOB)):
            memory.add(f"garden note number {number}", scope=scope)
        # Every scope's entries count: one worker drains the whole outbox.
        assert store.count_pending(2) == len(store.pending(100, 2)) == 5
        assert memory.process_outbox(max_batches=1) == 2
        assert store.count_pending(2) == len(store.pending(100, 2)) == 3
        failing = store.pending(1, 2)
        store.fail(failing, "embedder down")
        assert store.count_pending(2) == 3 and store.count_pending(1) == 2
        store.fail(failing, "embedder down")
        # Entries out of attempts are not pending (a re-embed gives them a fresh start).
        assert store.count_pending(2) == len(store.pending(100, 2)) == 2
        assert store.count_pending(5) == 3
        assert memory.pending() == 2
        waiting = store.pending(1, 2)[0]
        assert memory.forget(
            Scope(tenant_id=waiting.tenant_id, user_id=waiting.user_id), waiting.record_id
        )
        assert store.count_pending(2) == len(store.pending(100, 2)) == 1
        assert memory.process_outbox() == 1
        assert store.count_pending(2) == 0 and store.count_pending(5) == 1
        memory.close()

    def test_keyword_and_vector_search_rank_the_relevant_record(
        self, make_store: StoreFactory
    ) -> None:
        memory = _memory(make_store())
        texts = [
            "Alice adopted a cat named Miso",
            "Alice runs every morning before work",
            "Alice is allergic to peanuts",
            "The quarterly report is due on Friday",
        ]
        ids = [memory.add(t, scope=ALICE).id for t in texts]
        memory.flush()
        keyword = memory.store.keyword_search(ALICE, ["allergic", "peanuts"], MemoryFilter(), 10)
        assert keyword and keyword[0].record_id == ids[2]
        vector = memory.embedder.embed_one("allergic peanuts")  # type: ignore[union-attr]
        dense = memory.store.vector_search(ALICE, vector, "keel-hashing-64", MemoryFilter(), 2)
        assert dense and dense[0].record_id == ids[2]
        assert len(dense) == 2
        hits = memory.search("is Alice allergic to anything?", scope=ALICE, k=2)
        assert hits[0].record.id == ids[2]
        memory.close()

    def test_keyword_search_weighs_a_rare_word_above_a_common_one(
        self, make_store: StoreFactory
    ) -> None:
        # BM25's IDF: a name said in every turn must not outweigh the one rare word that
        # finds the answer. Without IDF the two kinds of match tie, and the tie goes to the
        # older records, the common ones here.
        memory = _memory(make_store())
        for number in range(6):
            memory.add(f"Caroline talked about her plans for day {number}", scope=ALICE)
            memory.add(f"the weather was mild on day {number}", scope=ALICE)
        rare = memory.add("the lgbtq support group met downtown on Sunday", scope=ALICE)
        memory.flush()
        keyword = memory.store.keyword_search(ALICE, ["caroline", "lgbtq"], MemoryFilter(), 5)
        assert [hit.record_id for hit in keyword][:1] == [rare.id]
        assert len(keyword) == 5
        memory.close()

    def test_a_word_in_most_of_a_scopes_rows_makes_no_row_a_keyword_match(
        self, make_store: StoreFactory
    ) -> None:
        # A word in more than half of the scope's own rows (the speaker's name opening each
        # turn) has a negative IDF there, however rare it is in the table; in more rows than
        # the search lists, the rows matching it alone would take every rank after the real
        # match: they are no keyword candidates. Only when it is all the scope holds of the
        # query does it still find rows.
        memory = _memory(make_store())
        said = {
            memory.add(f"Caroline: I planned the trip for day {number}", scope=ALICE).id
            for number in range(30)
        }
        memory.add("the weather was mild all week", scope=ALICE)
        rare = memory.add("the lgbtq support group met downtown on Sunday", scope=ALICE)
        for number in range(60):  # elsewhere in the table, nobody says it
            memory.add(f"Bob's own note {number} about invoices", scope=BOB)
        memory.flush()

        def found(terms: list[str]) -> list[str]:
            hits = memory.store.keyword_search(ALICE, terms, MemoryFilter(), 20)
            return [hit.record_id for hit in hits]

        assert found(["caroline", "lgbtq"]) == [rare.id]
        for alone in (["caroline"], ["caroline", "zebra"]):
            assert len(found(alone)) == 20 and set(found(alone)) <= said
        # Listing more rows than the word is in: every row is ranked, the shared word orders.
        every = memory.store.keyword_search(ALICE, ["caroline", "lgbtq"], MemoryFilter(), 40)
        assert [hit.record_id for hit in every][:1] == [rare.id]
        assert {hit.record_id for hit in every[1:]} == said
        memory.close()

    def test_keyword_search_in_a_dominant_scope_never_lists_another_tenants_rows(
        self, make_store: StoreFactory
    ) -> None:
        # A scope holding nearly the whole table (one user on a laptop) may leave the scope out
        # of the full-text match: then only the check on the rows keeps another tenant's rows,
        # with the same user id and the same words, out of the results (and of their slots).
        memory = _memory(make_store())
        mine = {
            memory.add(f"invoice {number} for the harbour crane", scope=ALICE).id
            for number in range(5)
        }
        for number in range(1_700):
            memory.add(f"alice's diary entry {number} about the weather", scope=ALICE)
        theirs = {
            memory.add(f"invoice {number} for the harbour crane", scope=EVE).id
            for number in range(40)
        }
        memory.flush()
        for limit in (3, 5, 50):
            hits = memory.store.keyword_search(ALICE, ["invoice", "crane"], MemoryFilter(), limit)
            found = {hit.record_id for hit in hits}
            assert found <= mine and not found & theirs
            assert len(found) == min(limit, len(mine))
        memory.close()

    def test_filters_apply(self, make_store: StoreFactory) -> None:
        memory = _memory(make_store())
        turn = memory.add("we talked about hiking boots", scope=ALICE, type="turn", session_id="a")
        fact = memory.add("owns hiking boots", scope=ALICE, kind="semantic", type="fact")
        memory.add("hiking boots workflow", scope=ALICE, kind="procedural", session_id="b")
        memory.flush()
        only_semantic = MemoryFilter(kinds=("semantic",))
        kw = memory.store.keyword_search(ALICE, ["hiking"], only_semantic, 10)
        assert [h.record_id for h in kw] == [fact.id]
        vector = memory.embedder.embed_one("hiking boots")  # type: ignore[union-attr]
        vs = memory.store.vector_search(ALICE, vector, "keel-hashing-64", only_semantic, 10)
        assert [h.record_id for h in vs] == [fact.id]
        session = MemoryFilter(session_id="a")
        assert [
            h.record_id for h in memory.store.keyword_search(ALICE, ["boots"], session, 10)
        ] == [turn.id]
        no_turns = MemoryFilter(exclude_types=("turn",))
        assert turn.id not in {
            h.record_id for h in memory.store.keyword_search(ALICE, ["boots"], no_turns, 10)
        }
        memory.close()

    def test_a_shown_session_is_left_out_in_the_query_not_after_it(
        self, make_store: StoreFactory
    ) -> None:
        # What a prompt shows of its session (turns 3 on, its summary) is never a candidate,
        # nor a neighbour of a hit: every search still fills its limit from the rest, even
        # when the shown records are the nearest ones by far. Everything else stays: the
        # session's earlier turns and its other records, another session's turns and summary
        # (the same turn numbers), records of no session.
        memory = _memory(make_store())
        store = memory.store
        kept: set[str] = set()
        shown_ids: set[str] = set()
        for number in range(1, 41):
            text = f"ledger entry shelf crate {number}"
            record = memory.add(text, scope=ALICE, type="turn", session_id="s", turn=number)
            (shown_ids if number >= 3 else kept).add(record.id)
        for session, text in (("s", "ledger shelf summary"), ("t", "ledger shelf summary of t")):
            key = f"summary:{session}"
            record = memory.add(text, scope=ALICE, type="summary", session_id=session, key=key)
            (shown_ids if session == "s" else kept).add(record.id)
        for number in range(1, 6):
            text = f"ledger note {number}"
            kept.add(memory.add(text, scope=ALICE, type="turn", session_id="t", turn=number).id)
        kept.add(memory.add("ledger note of s", scope=ALICE, type="note", session_id="s").id)
        kept.add(memory.add("ledger note of no session", scope=ALICE, type="note", turn=7).id)
        memory.add(
            "ledger entry shelf crate of bob", scope=BOB, type="turn", session_id="s", turn=9
        )
        memory.flush()
        shown = ShownSession(session_id="s", first_turn=3, summary_key="summary:s")
        filters = MemoryFilter(shown=shown)
        everything = kept | shown_ids
        assert {r.id for r in store.list_records(ALICE, filters, limit=100)} == kept
        assert {r.id for r in store.fetch(ALICE, sorted(everything), filters)} == kept
        keyword = store.keyword_search(ALICE, ["ledger"], filters, 100)
        assert {h.record_id for h in keyword} == kept
        vector = memory.embedder.embed_one("ledger entry shelf crate")  # type: ignore[union-attr]
        model = "keel-hashing-64"
        assert {h.record_id for h in store.vector_search(ALICE, vector, model, filters, 100)} == (
            kept
        )
        # The 38 shown turns are about the nearest 30 (a search for 5 reads the nearest 30 at
        # first, on SQLite), fewer than 5 of those are kept: a search for 5 still finds 5.
        nearest = store.vector_search(ALICE, vector, model, MemoryFilter(), 30)
        assert len({h.record_id for h in nearest} & kept) < 5
        five = store.vector_search(ALICE, vector, model, filters, 5)
        assert len(five) == 5 and {h.record_id for h in five} <= kept
        # Neighbours of a hit just before the shown turns stop where they start.
        hits = memory.search("ledger entry shelf crate 2", scope=ALICE, k=3, filters=filters)
        assert hits and all(r.id in kept for hit in hits for r in hit.records)
        assert any(r.turn == 2 and r.session_id == "s" for hit in hits for r in hit.records)
        # A session that shows nothing of itself in memory leaves nothing out.
        nothing = MemoryFilter(shown=ShownSession(session_id="s"))
        assert {r.id for r in store.list_records(ALICE, nothing, limit=100)} == everything
        memory.close()

    def test_session_turns_in_order(self, make_store: StoreFactory) -> None:
        memory = _memory(make_store())
        for number in (3, 1, 2, 5):
            memory.add(
                f"turn number {number}", scope=ALICE, type="turn", session_id="s", turn=number
            )
        memory.add("other session", scope=ALICE, type="turn", session_id="t", turn=2)
        turns = memory.store.session_turns(ALICE, "s", 1, 3)
        assert [t.turn for t in turns] == [1, 2, 3]
        assert memory.store.session_turns(BOB, "s", 0, 10) == []
        memory.close()

    def test_turns_around_reads_every_span_once_in_order(self, make_store: StoreFactory) -> None:
        memory = _memory(make_store())
        for session in ("s", "t"):
            for number in (4, 1, 3, 2, 5, 9):
                memory.add(
                    f"{session} turn {number}",
                    scope=ALICE,
                    type="turn",
                    session_id=session,
                    turn=number,
                )
        memory.add("bob's turn", scope=BOB, type="turn", session_id="s", turn=2)
        # Overlapping spans of one session, a span of another, one that holds nothing.
        spans = [("t", 8, 10), ("s", 1, 3), ("s", 2, 4), ("u", 0, 99)]
        around = memory.store.turns_around(ALICE, spans)
        assert [(r.session_id, r.turn) for r in around] == [
            ("s", 1),
            ("s", 2),
            ("s", 3),
            ("s", 4),
            ("t", 9),
        ]
        expected = {r.id for span in spans for r in memory.store.session_turns(ALICE, *span)}
        assert [r.id for r in around] == list(dict.fromkeys(r.id for r in around))
        assert {r.id for r in around} == expected
        assert memory.store.turns_around(BOB, [("s", 0, 10)])[0].text == "bob's turn"
        assert memory.store.turns_around(ALICE, []) == []
        memory.close()

    def test_turns_around_finds_what_each_span_finds_alone(self, make_store: StoreFactory) -> None:
        memory = _memory(make_store())
        turns = {"s": range(-2, 131), "t": range(-2, 16)}
        entries = [
            {
                "text": f"{session} turn {turn} said by the {speaker}",
                "type": "turn",
                "session_id": session,
                "turn": turn,
            }
            for session, numbers in turns.items()
            for turn in numbers
            if turn % 7 != 3  # some turns are missing
            for speaker in ("user", "assistant")  # two records a turn, in the order written
        ]
        written = [record.id for record in memory.add_many(entries, scope=ALICE)]
        cases = [
            [("s", 4, 6), ("s", 7, 9), ("s", 5, 5), ("t", 2, 4)],  # adjacent, nested
            [("s", 14, 16), ("s", 10, 12)],  # one turn apart
            [("s", 9, 4), ("t", -2, 1)],  # a reversed span holds nothing; turns below 0
            [("s", 0, 100), ("s", 120, 122), ("t", 10, 12)],  # one span wider than most
            [("s", n, n + 4) for n in range(0, 130, 10)],  # more turns than are listed
            [("s", 3, 3), ("u", 0, 5)],  # a missing turn, a session of nothing
        ]
        for spans in cases:
            around = memory.store.turns_around(ALICE, spans)
            alone = {r.id: r for span in spans for r in memory.store.session_turns(ALICE, *span)}
            expected = sorted(
                alone.values(), key=lambda r: (r.session_id, r.turn, written.index(r.id))
            )
            assert [r.id for r in around] == [r.id for r in expected], spans
            assert around or spans[0][1] == 3, spans  # the test means something
        memory.close()

    def test_delete_and_reembed(self, make_store: StoreFactory) -> None:
        memory = _memory(make_store())
        keep = memory.add("keep this memory", scope=ALICE)
        drop = memory.add("drop this memory", scope=ALICE)
        memory.flush()
        assert not memory.forget(BOB, drop.id)
        assert memory.forget(ALICE, drop.id)
        assert memory.get(ALICE, drop.id) is None
        vector = memory.embedder.embed_one("drop this memory")  # type: ignore[union-attr]
        ids = [
            h.record_id
            for h in memory.store.vector_search(
                ALICE, vector, "keel-hashing-64", MemoryFilter(), 10
            )
        ]
        assert ids == [keep.id]
        assert memory.store.embedding_models() == {"keel-hashing-64": 1}
        wider = Memory(memory.store, embedder=HashingEmbedder(32), masker=None)
        assert wider.embedding_status().needs_reembed
        assert wider.reembed() == 1
        assert memory.store.embedding_models() == {"keel-hashing-32": 1}
        v32 = wider.embedder.embed_one("keep this memory")  # type: ignore[union-attr]
        found = memory.store.vector_search(ALICE, v32, "keel-hashing-32", MemoryFilter(), 5)
        assert [h.record_id for h in found] == [keep.id]
        assert np.isclose(
            memory.store.vectors(ALICE, [keep.id], "keel-hashing-32")[keep.id] @ v32, 1.0, atol=1e-5
        )
        memory.close()

    def test_texts_without_words_match_nothing(self, make_store: StoreFactory) -> None:
        # The hashing embedder maps a text with no words to the zero vector, whose cosine
        # with anything is undefined: it must neither match a query nor be matched.
        memory = _memory(make_store())
        memory.add("...", scope=ALICE)
        allergy = memory.add("Alice is allergic to peanuts", scope=ALICE)
        memory.flush()
        assert [h.record.id for h in memory.search("allergic", scope=ALICE)] == [allergy.id]
        zero = memory.embedder.embed_one("?!")  # type: ignore[union-attr]
        assert not zero.any()
        assert memory.search("?!", scope=ALICE) == []
        hits = memory.store.vector_search(ALICE, zero, "keel-hashing-64", MemoryFilter(), 10)
        assert all(h.score <= 0.0 for h in hits)
        memory.close()

    def test_tenant_isolation_against_crafted_queries(self, make_store: StoreFactory) -> None:
        memory = _memory(make_store())
        secret = memory.add("bob secret: the vault code is 4417", scope=BOB, session_id="bob-s")
        evil = memory.add("alice secret in another tenant", scope=EVE)
        mine = memory.add("alice likes secret gardens", scope=ALICE)
        memory.flush()
        foreign = {secret.id, evil.id}
        for query in (*INJECTIONS, "bob secret vault code", "secret"):
            hits = memory.search(query, scope=ALICE, k=10)
            assert not foreign & {r.id for h in hits for r in h.records}, query
            packed = memory.retrieve(query, scope=ALICE, budget_tokens=500)
            assert "vault" not in packed.text and "another tenant" not in packed.text
        crafted = MemoryFilter(session_id="bob-s", include_superseded=True, types=("note",))
        assert memory.search("bob secret vault", scope=ALICE, filters=crafted) == []
        assert memory.store.list_records(ALICE, crafted) == []
        assert memory.store.session_turns(ALICE, "bob-s", -100, 100) == []
        assert memory.store.turns_around(ALICE, [("bob-s", -100, 100)]) == []
        assert memory.get(ALICE, secret.id) is None
        assert memory.store.fetch(ALICE, [secret.id, evil.id, mine.id], MemoryFilter()) == [
            memory.get(ALICE, mine.id)
        ]
        vector = memory.embedder.embed_one("bob secret vault code")  # type: ignore[union-attr]
        near = memory.store.vector_search(ALICE, vector, "keel-hashing-64", MemoryFilter(), 10)
        assert {h.record_id for h in near} == {mine.id}
        assert memory.store.list_records(ALICE, MemoryFilter(), limit=10) == [
            memory.get(ALICE, mine.id)
        ]
        assert not memory.forget(ALICE, secret.id)
        assert memory.get(BOB, secret.id) is not None
        memory.close()

    # --- write isolation --------------------------------------------------------------------

    def test_a_fact_never_supersedes_another_scopes_fact(self, make_store: StoreFactory) -> None:
        memory = _memory(make_store())
        mine = memory.remember_fact(ALICE, "alice", "home city", "Lisbon")
        copies = {}
        for other in OTHERS:
            # The very same fact (subject, attribute, text, hash) stored for another scope.
            copy = mine.model_copy(
                update={
                    "id": uuid.uuid4().hex,
                    "tenant_id": other.tenant_id,
                    "user_id": other.user_id,
                }
            )
            result = memory.store.insert(copy)
            assert result.created and result.record.id == copy.id
            assert result.superseded == (), other
            copies[other] = copy
        history = memory.fact_history(ALICE, "alice", "home city")
        assert [(r.id, r.valid_to) for r in history] == [(mine.id, None)]
        # Each neighbour changes its own value: only its own copy becomes history.
        for other in OTHERS:
            theirs = memory.remember_fact(other, "alice", "home city", "Porto")
            assert [r.id for r in memory.fact_history(other, "alice", "home city")] == [
                copies[other].id,
                theirs.id,
            ]
            assert [r.id for r in memory.profile(other)] == [theirs.id]
        history = memory.fact_history(ALICE, "alice", "home city")
        assert [(r.id, r.valid_to) for r in history] == [(mine.id, None)]
        assert [r.id for r in memory.profile(ALICE)] == [mine.id]
        # And Alice's own change leaves both neighbours' current values alone.
        newer = memory.remember_fact(ALICE, "alice", "home city", "Faro")
        assert [r.id for r in memory.profile(ALICE)] == [newer.id]
        for other in OTHERS:
            current = memory.profile(other)
            assert len(current) == 1 and current[0].valid_to is None, other
            assert current[0].metadata["value"] == "Porto"
        memory.close()

    def test_indexing_one_scopes_pending_records_leaves_the_others_waiting(
        self, make_store: StoreFactory
    ) -> None:
        """A search's read-your-writes embeds its own scope's waiting records, never another
        scope's backlog."""
        memory = _memory(make_store())
        mine = {memory.add(f"alice note {n}", scope=ALICE).id for n in range(3)}
        for other in OTHERS:
            memory.add("a note of someone else", scope=other)
        assert {entry.record_id for entry in memory.store.pending(100, scope=ALICE)} == mine
        assert memory.index_pending(ALICE) == 3
        assert memory.store.pending(100, scope=ALICE) == []
        assert memory.pending() == len(OTHERS)
        assert set(memory.store.vectors(ALICE, sorted(mine), "keel-hashing-64")) == mine
        memory.close()

    def test_forget_never_deletes_another_scopes_record(self, make_store: StoreFactory) -> None:
        memory = _memory(make_store())
        text = "the spare key is under the blue flowerpot"
        records = {scope: memory.add(text, scope=scope) for scope in (ALICE, *OTHERS)}
        assert len({record.id for record in records.values()}) == 3
        memory.flush()
        for owner, record in records.items():
            for intruder in records:
                if intruder != owner:
                    assert not memory.forget(intruder, record.id), (intruder, owner)
        vector = memory.embedder.embed_one("blue flowerpot key")  # type: ignore[union-attr]
        for owner, record in records.items():
            assert memory.get(owner, record.id) is not None, owner
            keyword = memory.store.keyword_search(owner, ["flowerpot"], MemoryFilter(), 10)
            assert [h.record_id for h in keyword] == [record.id]
            near = memory.store.vector_search(owner, vector, "keel-hashing-64", MemoryFilter(), 10)
            assert [h.record_id for h in near] == [record.id]
        # Each owner forgets its own: the neighbours keep theirs.
        assert memory.forget(EVE, records[EVE].id)
        assert memory.forget(BOB, records[BOB].id)
        assert memory.get(ALICE, records[ALICE].id) is not None
        assert memory.store.count() == 1
        assert [h.record.id for h in memory.search("flowerpot key", scope=ALICE)] == [
            records[ALICE].id
        ]
        memory.close()

    def test_reembed_keeps_every_vector_in_its_scope(self, make_store: StoreFactory) -> None:
        memory = _memory(make_store())
        texts = {
            ALICE: "alice keeps the spare key under the mat",
            BOB: "bob keeps the spare key in the shed",
            EVE: "eve keeps the spare key in a safe",
        }
        records = {scope: memory.add(text, scope=scope) for scope, text in texts.items()}
        memory.flush()
        old = memory.embedder.embed_one("spare key")  # type: ignore[union-attr]
        for scope in texts:  # searched before the re-embed, so any per-scope cache is warm
            assert (
                len(memory.store.vector_search(scope, old, "keel-hashing-64", MemoryFilter(), 9))
                == 1
            )
        wider = Memory(memory.store, embedder=HashingEmbedder(32), masker=None)
        assert wider.reembed() == 3
        assert memory.store.embedding_models() == {"keel-hashing-32": 3}
        assert wider.embedder is not None
        query = wider.embedder.embed_one("spare key")
        every_id = [record.id for record in records.values()]
        for scope, record in records.items():
            near = memory.store.vector_search(scope, query, "keel-hashing-32", MemoryFilter(), 10)
            assert [h.record_id for h in near] == [record.id], scope
            vectors = memory.store.vectors(scope, every_id, "keel-hashing-32")
            assert list(vectors) == [record.id], scope
            own = wider.embedder.embed_one(texts[scope])
            assert np.isclose(vectors[record.id] @ own, 1.0, atol=1e-5)
            stored = memory.get(scope, record.id)
            assert stored is not None and stored.embedding_model == "keel-hashing-32"
            assert stored.text == texts[scope]
            assert [h.record.id for h in wider.search("spare key", scope=scope, k=10)] == [
                record.id
            ]
        memory.close()

    # --- a user's erasure and retention -------------------------------------------------------

    def test_erase_user_deletes_their_records_vectors_and_index_and_only_theirs(
        self, make_store: StoreFactory
    ) -> None:
        memory = _memory(make_store())
        for scope in (ALICE, *OTHERS):
            memory.add("zanzibarian quokka flight", scope=scope, kind="episodic", session_id="s1")
        memory.add("second note", scope=ALICE, kind="semantic", session_id="s2")
        memory.flush()
        assert memory.store.user_sessions("acme", "alice") == ["s1", "s2"]
        erased = memory.store.erase_user("acme", "alice")
        assert erased["memory_records"] == 2 and erased["memory_vectors"] == 2
        assert memory.store.count(ALICE) == 0
        assert memory.search("zanzibarian quokka", scope=ALICE) == []
        for other in OTHERS:
            assert memory.store.count(other) == 1
            assert len(memory.search("zanzibarian quokka", scope=other)) == 1
        assert set(memory.store.erase_user("acme", "alice").values()) == {0}
        memory.close()

    def test_prune_by_age_and_by_count_per_user_within_one_tenant_and_kind(
        self, make_store: StoreFactory
    ) -> None:
        from datetime import UTC, datetime, timedelta

        memory = _memory(make_store())
        now = datetime.now(UTC)
        for scope in (ALICE, BOB, EVE):
            for days in (40, 20, 10, 1):
                memory.add(
                    f"note {days} days old",
                    scope=scope,
                    kind="episodic",
                    event_time=now - timedelta(days=days),
                )
            memory.add("a fact kept", scope=scope, kind="semantic")
        store = memory.store
        assert store.tenants() == ["acme", "evil-corp"]
        # Created now: none is older than a day; each acme user keeps their newest 2 turns.
        assert store.prune("acme", "episodic", before=now - timedelta(days=1), keep=2) == 4
        for scope in (ALICE, BOB):
            kept = store.list_records(scope, MemoryFilter(kinds=("episodic",)))
            assert [record.text for record in kept] == ["note 1 days old", "note 10 days old"]
            assert store.count(scope) == 3
        assert store.count(EVE) == 5
        assert store.prune("acme", "episodic", before=None, keep=2) == 0
        assert store.prune("acme", "episodic", before=now + timedelta(seconds=5), keep=None) == 4
        assert store.count(ALICE) == 1 and store.count(EVE) == 5
        memory.close()
