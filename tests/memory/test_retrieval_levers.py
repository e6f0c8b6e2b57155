"""The retrieval levers (dates in a query, multi-hop expansion, session spread, wider context
for the best hits), each through ``Memory.search`` on a real SQLite store."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from keel.memory import HashingEmbedder, Memory, RetrievalConfig, Scope
from keel.memory._expansion import entity_terms
from keel.memory._shape import is_broad
from keel.memory._temporal import time_ranges
from keel.stores import SQLiteDatabase, SQLiteMemoryStore

SCOPE = Scope(tenant_id="acme", user_id="u1")
NOW = datetime(2023, 8, 10, 12, 0, tzinfo=UTC)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SQLiteMemoryStore]:
    database = SQLiteDatabase(tmp_path / "m.db")
    memory_store = SQLiteMemoryStore(database)
    yield memory_store
    memory_store.close()
    database.close()


def _memory(store: SQLiteMemoryStore, embedder: bool = False, **config: float) -> Memory:
    return Memory(
        store,
        embedder=HashingEmbedder(64) if embedder else None,
        # Every lever off unless the test turns it on (some are on by default).
        config=RetrievalConfig.model_validate(
            {
                "recency_weight": 0.0,
                "temporal_weight": 0.0,
                "wide_hits": 0,
                "expansion_weight": 0.0,
                "context_reach": 0,
                "context_hits": 0,
                "broad_reach": 0,
                "broad_spread": 0.0,
                "broad_spread_after": 0,
                **config,
            }
        ),
    )


def _texts(memory: Memory, query: str, k: int) -> list[str]:
    return [hit.record.text for hit in memory.search(query, scope=SCOPE, k=k, now=NOW)]


def test_dates_in_a_query_become_time_ranges() -> None:
    (day,) = time_ranges("What did Maria plan on the evening of 7 July, 2023?", NOW)
    assert day.contains(datetime(2023, 7, 7, 18, 0, tzinfo=UTC))
    assert day.contains(datetime(2023, 7, 12, tzinfo=UTC))  # told about within the week
    assert not day.contains(datetime(2023, 7, 5, tzinfo=UTC))
    (other_order,) = time_ranges("Who did she meet on May 3, 2023?", NOW)
    assert other_order.contains(datetime(2023, 5, 3, tzinfo=UTC))
    assert not other_order.contains(datetime(2023, 5, 20, tzinfo=UTC))
    (month,) = time_ranges("What did Maria donate in December 2023?", NOW)
    assert month.contains(datetime(2023, 12, 30, tzinfo=UTC))
    assert not month.contains(datetime(2023, 11, 30, tzinfo=UTC))
    (june,) = time_ranges("When did Melanie go camping in June?", NOW)
    assert june.contains(datetime(2021, 6, 15, tzinfo=UTC))
    assert not june.contains(datetime(2021, 8, 15, tzinfo=UTC))
    (last_week,) = time_ranges("What did John do last week?", NOW)
    assert last_week.contains(datetime(2023, 8, 4, tzinfo=UTC))
    assert not last_week.contains(datetime(2023, 6, 1, tzinfo=UTC))
    (ago,) = time_ranges("Where did she move three months ago?", NOW)
    assert ago.contains(datetime(2023, 5, 12, tzinfo=UTC))
    assert not ago.contains(datetime(2023, 8, 1, tzinfo=UTC))
    assert time_ranges("What is the name of Ben's dog?", NOW) == []
    # "may" the verb names no month.
    assert time_ranges("Who may come to the party?", NOW) == []


def test_a_date_in_the_query_lifts_the_memory_of_that_day(store: SQLiteMemoryStore) -> None:
    writer = _memory(store)
    writer.add(
        "Maria: dinner with my mother",
        scope=SCOPE,
        event_time=datetime(2023, 4, 2, tzinfo=UTC),
    )
    writer.add(
        "Maria: we went out with the gym friends for dinner after a long day at the shelter",
        scope=SCOPE,
        event_time=datetime(2023, 5, 3, 19, 0, tzinfo=UTC),
    )
    query = "Who did Maria have dinner with on May 3, 2023?"
    assert _texts(_memory(store), query, 1) == ["Maria: dinner with my mother"]
    assert _texts(_memory(store, temporal_weight=1.0), query, 1) == [
        "Maria: we went out with the gym friends for dinner after a long day at the shelter"
    ]
    # A query that names no date ranks as without the lever.
    assert _texts(_memory(store, temporal_weight=1.0), "Who did Maria have dinner with?", 1) == [
        "Maria: dinner with my mother"
    ]


def test_names_of_a_first_hit_are_searched_in_a_second_hop(store: SQLiteMemoryStore) -> None:
    assert entity_terms(
        ["Ann: We moved when Erik got the job in Gothenburg. Yesterday was fun."], ["ann", "move"]
    ) == ["erik", "gothenburg"]
    writer = _memory(store)
    writer.add("Ann: We moved when Erik got the job in Gothenburg.", scope=SCOPE)
    writer.add("Ben: Gothenburg has the best harbour in the north.", scope=SCOPE)
    writer.add("Ben: I like pottery and long walks.", scope=SCOPE)
    query = "Where did Ann move?"
    assert _texts(_memory(store), query, 3) == [
        "Ann: We moved when Erik got the job in Gothenburg."
    ]
    assert _texts(_memory(store, expansion_weight=0.5, expansion_seeds=1), query, 3) == [
        "Ann: We moved when Erik got the job in Gothenburg.",
        "Ben: Gothenburg has the best harbour in the north.",
    ]


def test_expansion_follows_a_first_hits_names_and_never_lifts_the_hit_itself(
    store: SQLiteMemoryStore,
) -> None:
    writer = _memory(store, embedder=True)
    for text in [
        "Alice adopted a cat named Miso",
        "Alice runs every morning before work",
        "Alice is allergic to peanuts",
        "The quarterly report is due on Friday",
        "Miso sleeps on the windowsill all afternoon",
    ]:
        writer.add(text, scope=SCOPE)
    writer.flush()
    # The levers at their defaults, expansion turned on as `keel bench locomo --cv` tunes it.
    default = Memory(
        store,
        embedder=HashingEmbedder(64),
        config=RetrievalConfig(expansion_weight=0.25, expansion_seeds=3),
    )
    # The cat's record is one of the best hits and names Miso; the names a seed mentions
    # never lift the seed itself, so the answer stays on top ...
    hits = default.search("is Alice allergic to anything?", scope=SCOPE, k=5, now=NOW)
    assert hits[0].record.text == "Alice is allergic to peanuts"
    # ... and the record only the cat's name leads to is found in the second hop.
    texts = [hit.record.text for hit in hits]
    assert "Miso sleeps on the windowsill all afternoon" in texts
    off = _memory(store, embedder=True, recency_weight=0.05, temporal_weight=4.0, wide_hits=6)
    assert "Miso sleeps on the windowsill all afternoon" not in [
        hit.record.text
        for hit in off.search("is Alice allergic to anything?", scope=SCOPE, k=5, now=NOW)
    ]


def test_expansion_seeds_are_read_once_per_search(
    store: SQLiteMemoryStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = _memory(store, embedder=True)
    for text in [
        "Alice adopted a cat named Miso",
        "Alice runs every morning before work",
        "Alice is allergic to peanuts",
        "Miso sleeps on the windowsill all afternoon",
    ]:
        writer.add(text, scope=SCOPE)
    writer.flush()
    default = Memory(
        store,
        embedder=HashingEmbedder(64),
        config=RetrievalConfig(expansion_weight=0.25, expansion_seeds=3),
    )
    before = default.search("is Alice allergic to anything?", scope=SCOPE, k=4, now=NOW)
    read: list[str] = []
    fetch = store.fetch

    def counted_fetch(*args: object, **kwargs: object) -> object:
        records = fetch(*args, **kwargs)  # type: ignore[arg-type]
        read.extend(record.id for record in records)
        return records

    monkeypatch.setattr(store, "fetch", counted_fetch)
    hits = default.search("is Alice allergic to anything?", scope=SCOPE, k=4, now=NOW)
    # The seeds the expansion read for their names are ranked from that read, not read
    # again: every record is fetched once, and the hits are what they were.
    assert read and len(read) == len(set(read))
    assert [(h.record.id, h.score) for h in hits] == [(h.record.id, h.score) for h in before]


def test_session_spread_gives_a_second_session_a_hit(store: SQLiteMemoryStore) -> None:
    writer = _memory(store)
    for turn, text in enumerate(
        ["hiking trip hiking boots", "hiking trip in the rain", "hiking trip photos"]
    ):
        writer.add(text, scope=SCOPE, session_id="s1", turn=turn)
    writer.add("a hiking weekend", scope=SCOPE, session_id="s2", turn=0)
    query = "hiking trip"
    plain = _memory(store, neighbours=0)
    assert {h.record.session_id for h in plain.search(query, scope=SCOPE, k=2, now=NOW)} == {"s1"}
    spread = _memory(store, neighbours=0, session_spread=0.5)
    hits = spread.search(query, scope=SCOPE, k=2, now=NOW)
    assert [h.record.session_id for h in hits] == ["s1", "s2"]


def test_the_best_hits_get_one_more_turn_each_side(store: SQLiteMemoryStore) -> None:
    writer = _memory(store, embedder=True)
    for turn in range(7):
        text = "the telescope arrived" if turn == 3 else f"small talk number {turn}"
        writer.add(text, scope=SCOPE, session_id="s1", turn=turn)
    writer.flush()

    def shown(memory: Memory) -> list[int | None]:
        (hit, *_) = memory.search("telescope", scope=SCOPE, k=1, now=NOW)
        return [record.turn for record in hit.records]

    assert shown(_memory(store, embedder=True)) == [2, 3, 4]
    assert shown(_memory(store, embedder=True, wide_hits=1)) == [1, 2, 3, 4, 5]

    writer.add("the telescope is heavy", scope=SCOPE, session_id="s2", turn=0)
    writer.add("small talk in another session", scope=SCOPE, session_id="s2", turn=1)
    writer.flush()
    narrow = _memory(store, embedder=True, context_hits=1)
    hits = narrow.search("telescope", scope=SCOPE, k=2, now=NOW)
    assert [len(hit.records) for hit in hits] == [3, 1]
    assert [
        len(hit.records)
        for hit in _memory(store, embedder=True).search("telescope", scope=SCOPE, k=2, now=NOW)
    ] == [3, 2]


def test_spread_after_spares_the_best_hits(store: SQLiteMemoryStore) -> None:
    writer = _memory(store)
    for turn, text in enumerate(
        ["hiking trip hiking boots", "hiking trip in the rain", "hiking trip photos"]
    ):
        writer.add(text, scope=SCOPE, session_id="s1", turn=turn)
    writer.add("a hiking weekend", scope=SCOPE, session_id="s2", turn=0)

    def sessions(**config: float) -> list[str | None]:
        memory = _memory(store, neighbours=0, **config)
        return [h.record.session_id for h in memory.search("hiking trip", scope=SCOPE, k=3)]

    assert sessions() == ["s1", "s1", "s1"]
    # Spread from the first pick: the second hit already goes to the other session ...
    assert sessions(session_spread=0.9) == ["s1", "s2", "s1"]
    # ... spared for the best two: they are picked by relevance alone, the third spreads.
    assert sessions(session_spread=0.9, spread_after=2) == ["s1", "s1", "s2"]


def test_context_reach_shows_the_well_ranked_turns_near_a_hit(store: SQLiteMemoryStore) -> None:
    writer = _memory(store)
    texts = {4: "the telescope arrived today", 7: "the telescope lens", 9: "a telescope stand"}
    for turn in range(10):
        writer.add(
            texts.get(turn, f"small talk number {turn}"), scope=SCOPE, session_id="s1", turn=turn
        )

    def shown(**config: float) -> list[int | None]:
        (hit,) = _memory(store, **config).search("telescope arrived", scope=SCOPE, k=1, now=NOW)
        return [record.turn for record in hit.records]

    assert shown() == [3, 4, 5]
    # Turn 7 ranks on its own and is within 3 turns: shown. Turn 6 (between) does not rank;
    # turn 9 ranks but is 5 turns away.
    assert shown(context_reach=3) == [3, 4, 5, 7]
    assert shown(context_reach=5) == [3, 4, 5, 7, 9]
    # Like ``wide_hits`` it widens a context and never creates one.
    assert shown(context_reach=3, neighbours=0) == [4]


def test_a_question_about_one_event_is_told_from_a_broad_one() -> None:
    assert is_broad("What books has Melanie read?", NOW)
    assert is_broad("What are Joanna's hobbies?", NOW)
    assert not is_broad("What did Melanie read last summer?", NOW)  # past tense
    assert not is_broad("When is Tim going to Ireland?", NOW)
    assert not is_broad("What is Tim reading in July 2023?", NOW)  # a date it names
    assert not is_broad("What is Tim reading these days, as of last week?", NOW)


def _telescope_talk(store: SQLiteMemoryStore) -> None:
    """Two sessions talking about a telescope, with small talk around each mention."""
    writer = _memory(store)
    texts = {
        ("s1", 2): "my telescope arrived",
        ("s1", 5): "the telescope lens is scratched",
        ("s2", 2): "a telescope for my birthday",
    }
    for session in ("s1", "s2"):
        for turn in range(8):
            text = texts.get((session, turn), f"small talk number {turn} in {session}")
            writer.add(text, scope=SCOPE, session_id=session, turn=turn)


def _blocks(memory: Memory, query: str, k: int) -> list[tuple[str | None, list[int | None]]]:
    return [
        (hit.record.session_id, [record.turn for record in hit.records])
        for hit in memory.search(query, scope=SCOPE, k=k, now=NOW)
    ]


def test_narrow_context_hits_leave_the_later_hits_of_a_one_event_question_alone(
    store: SQLiteMemoryStore,
) -> None:
    _telescope_talk(store)
    narrow = "When did the telescope arrive?"
    broad = "What does she think of telescopes and the telescope?"
    plain = _memory(store)
    assert [len(turns) for _, turns in _blocks(plain, narrow, 2)] == [3, 3]
    lever = _memory(store, narrow_context_hits=1)
    # The question about one event: the second hit comes alone ...
    assert [len(turns) for _, turns in _blocks(lever, narrow, 2)] == [3, 1]
    # ... a broad one keeps every hit's neighbours, as without the lever.
    assert _blocks(lever, broad, 2) == _blocks(plain, broad, 2)
    assert all(len(turns) == 3 for _, turns in _blocks(lever, broad, 2))


def test_broad_reach_shows_well_ranked_turns_near_the_hits_of_a_broad_question(
    store: SQLiteMemoryStore,
) -> None:
    _telescope_talk(store)
    broad = "What telescope has she got?"
    narrow = "What telescope did she get?"
    lever = _memory(store, broad_reach=3)
    # The broad question: turn 5 (the lens) ranks on its own, 3 turns from the hit at 2.
    assert _blocks(lever, broad, 1) == [("s1", [1, 2, 3, 5])]
    assert _blocks(_memory(store), broad, 1) == [("s1", [1, 2, 3])]
    # The question about one event is left as it was.
    assert _blocks(lever, narrow, 1) == [("s1", [1, 2, 3])]


def test_broad_spread_gives_a_broad_question_hits_in_more_sessions(
    store: SQLiteMemoryStore,
) -> None:
    _telescope_talk(store)
    broad = "What has she said about her telescope?"
    narrow = "What did she say about her telescope?"

    def sessions(query: str, **config: float) -> list[str | None]:
        return [s for s, _ in _blocks(_memory(store, neighbours=0, **config), query, 2)]

    assert sessions(broad) == ["s1", "s1"]
    assert sessions(broad, broad_spread=0.9) == ["s1", "s2"]
    assert sessions(narrow, broad_spread=0.9) == ["s1", "s1"]
    # Spared hits are picked by relevance alone.
    assert sessions(broad, broad_spread=0.9, broad_spread_after=2) == ["s1", "s1"]


def test_a_block_too_big_for_the_budget_is_packed_as_its_hit_alone(
    store: SQLiteMemoryStore,
) -> None:
    writer = _memory(store)
    for turn in range(12):
        writer.add(f"pasta recipe number {turn} with basil", scope=SCOPE, session_id="s", turn=turn)
    memory = _memory(store, broad_reach=8)
    (hit,) = memory.search("pasta recipe with basil", scope=SCOPE, k=1, now=NOW)
    assert len(hit.records) > 5  # the well-ranked turns around it join its block
    packed = memory.retrieve(
        "pasta recipe with basil", scope=SCOPE, budget_tokens=40, k=1, include_profile=False
    )
    (item,) = packed.items
    assert item.record_ids == (hit.record.id,)
    assert item.text.endswith(hit.record.text)
