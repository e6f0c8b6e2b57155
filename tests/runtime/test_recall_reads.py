"""What a recall reads, and that reading less left what it finds alone (issue 47, a memory-on
turn): a search tops its scope's vector index up once (its MMR step asked the store to do it
again), checks the nearest ids by rowid (a deleted record's rowid may be another's now; a
record stored again under its id has another rowid), computes the similarity rows MMR asks
for instead of the whole matrix, and reads the hits' neighbouring turns by listing them.

The guard over all of it: a seeded workload's searches find what they found before these
changes (the expected blocks below were written by the code before them).
"""

from __future__ import annotations

import random
import uuid
from datetime import UTC, datetime, timedelta

import numpy as np
import pytest

from keel.memory import HashingEmbedder, Memory, MemoryFilter, MemoryHit, RetrievalConfig, Scope
from keel.memory._records import MemoryRecord, ShownSession
from keel.memory._retrieval import Retriever, _Ranked, _SimilarityRows, best_first, by_score
from keel.memory._store import ScoredId
from keel.stores import SQLiteDatabase, SQLiteMemoryStore

_ADA = Scope(tenant_id="default", user_id="ada")
_NOW = datetime(2026, 3, 1, tzinfo=UTC)

_ITEMS = ["boxes", "keys", "tickets", "invoices", "plants", "bikes", "lamps", "letters"]
_PLACES = ["garage", "attic", "office", "kitchen", "shed", "cellar"]
_QUERIES = [
    "Where are the keys kept?",
    "what did we say about the plants in the kitchen",
    "Which invoices went to the office, and when?",
    "bikes in the shed",
    "Did Ada move the lamps to the attic?",
    "letters tickets cellar",
]


def _seeded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Record ids from one seeded generator and a clock that ticks a second a record: ties
    between equal scores (broken by id) and recency fall the same way in every run."""
    ids = random.Random(47)
    monkeypatch.setattr(uuid, "uuid4", lambda: uuid.UUID(int=ids.getrandbits(128), version=4))
    ticks = iter(range(10**6))
    monkeypatch.setattr(
        "keel.memory._memory.utcnow", lambda: _NOW - timedelta(days=30, seconds=-next(ticks))
    )


def _workload(memory: Memory) -> None:
    rng = random.Random(7)
    entries = []
    for session in range(3):
        for turn in range(40):
            item, place = rng.choice(_ITEMS), rng.choice(_PLACES)
            other = rng.choice(_ITEMS)
            entries.append(
                {
                    "text": f"Turn {turn}: Ada put the {item} in the {place}, next to the {other}.",
                    "session_id": f"s{session}",
                    "turn": turn,
                }
            )
    memory.add_many(entries, scope=_ADA)
    memory.flush()


def _blocks(hits: list[MemoryHit]) -> list[str]:
    return [
        f"{hit.record.session_id}:{hit.record.turn}"
        f"{[record.turn for record in hit.records if record.id != hit.record.id]}"
        for hit in hits
    ]


def _searches(memory: Memory) -> list[list[str]]:
    shown = MemoryFilter(exclude_types=("run",), shown=ShownSession(session_id="s2", first_turn=25))
    found = []
    for query in _QUERIES:
        found.append(_blocks(memory.search(query, scope=_ADA, now=_NOW)))
        found.append(_blocks(memory.search(query, scope=_ADA, filters=shown, now=_NOW)))
    found.append(_blocks(memory.search(_QUERIES[0], scope=_ADA, now=_NOW, distinct=False)))
    return found


def test_a_seeded_workloads_searches_find_what_they_found_before(
    database: SQLiteDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    _seeded(monkeypatch)
    memory = Memory(SQLiteMemoryStore(database), embedder=HashingEmbedder(dimension=256))
    _workload(memory)
    found = _searches(memory)
    assert found == _EXPECTED
    memory.close()


# What the code before issue 47's read changes found (ids aside: session:turn[neighbours]).
_EXPECTED: list[list[str]] = [
    [
        "s0:22[19, 20, 21, 23, 24, 25, 28, 29]",
        "s1:10[8, 9, 11, 12, 13, 14, 15, 16, 17, 19]",
        "s0:1[0, 2, 3, 4, 5, 6, 11]",
        "s2:1[0, 2, 3, 5, 10]",
        "s1:1[0, 2]",
        "s2:31[30, 32, 34, 36, 37]",
    ],
    [
        "s0:22[19, 20, 21, 23, 24, 25, 28, 29]",
        "s1:10[2, 8, 9, 11, 12, 13, 14, 15, 16, 17, 19]",
        "s0:1[0, 2, 3, 4, 5, 6, 11]",
        "s2:1[0, 2, 3, 4, 5, 6, 10]",
        "s1:1[0]",
    ],
    [
        "s0:10[8, 9, 11, 12]",
        "s0:4[2, 3, 5, 6]",
        "s0:39[38]",
        "s1:23[22, 24]",
        "s2:27[26, 28]",
        "s0:36[35, 37]",
        "s2:29[30]",
        "s1:10[9, 11]",
    ],
    [
        "s0:10[8, 9, 11, 12]",
        "s0:4[2, 3, 5, 6]",
        "s0:39[38]",
        "s1:23[22, 24]",
        "s0:36[35, 37]",
        "s1:10[8, 9, 11]",
        "s1:20[19, 21]",
        "s2:12[]",
    ],
    [
        "s1:38[36, 39]",
        "s2:13[11, 12, 14, 15]",
        "s1:13[12, 14]",
        "s0:17[16, 18]",
        "s1:28[27, 29]",
        "s2:39[38]",
        "s1:4[3, 5]",
        "s1:0[1]",
        "s0:23[]",
    ],
    [
        "s1:38[36, 39]",
        "s2:13[11, 12, 14, 15]",
        "s0:17[16, 18]",
        "s1:13[12, 14]",
        "s1:28[27, 29]",
        "s1:4[3, 5]",
        "s1:0[1]",
        "s0:23[22, 24]",
        "s0:20[]",
    ],
    [
        "s0:2[0, 1, 3, 4, 6, 9]",
        "s1:18[16, 17, 19, 20, 22, 24]",
        "s1:6[5, 7]",
        "s0:26[19, 21, 22, 25, 27, 32, 33]",
        "s2:26[22, 25, 27]",
        "s2:9[0, 4, 7, 8, 10, 14, 17]",
        "s0:14[11, 13, 15, 16, 17]",
        "s1:27[26, 28, 29, 35]",
    ],
    [
        "s0:2[0, 1, 3, 4, 6, 9]",
        "s1:18[16, 17, 19, 20, 22, 24]",
        "s1:6[5, 7]",
        "s0:26[19, 21, 22, 25, 27, 32, 33]",
        "s2:9[0, 4, 7, 8, 10, 14, 15, 16, 17, 18, 22]",
        "s0:14[11, 13, 15, 16, 17]",
        "s1:27[26, 28, 29, 34, 35]",
    ],
    [
        "s0:0[1, 2]",
        "s1:30[28, 29, 31, 32]",
        "s1:5[4, 6]",
        "s1:16[15, 17]",
        "s2:3[2, 4, 5]",
        "s2:38[37, 39]",
        "s1:11[]",
    ],
    [
        "s0:0[1, 2]",
        "s1:30[28, 29, 31, 32]",
        "s1:16[15, 17]",
        "s1:5[4, 6]",
        "s2:3[2, 4, 5]",
        "s0:37[36, 38]",
        "s1:1[0, 2]",
        "s1:11[]",
    ],
    [
        "s1:8[3, 4, 6, 7, 9, 10]",
        "s2:16[8, 9, 14, 15, 17, 18, 21]",
        "s2:0[1, 2, 3, 6, 7]",
        "s0:18[7, 14, 15, 16, 17, 19, 23, 24, 26]",
        "s1:17[16, 18, 20, 22, 25]",
        "s0:29[27, 28, 30, 31]",
    ],
    [
        "s1:8[2, 3, 4, 6, 7, 9, 10, 14]",
        "s2:16[8, 9, 14, 15, 17, 18, 21]",
        "s2:0[1, 2, 3, 6, 7]",
        "s0:18[7, 10, 14, 15, 16, 17, 19, 20, 23, 24, 26]",
        "s1:17[16, 18, 20, 22, 25]",
        "s0:29[27, 28, 30, 31]",
    ],
    [
        "s0:22[19, 20, 21, 23, 24, 25, 28, 29]",
        "s1:10[8, 9, 11, 12, 13, 14, 15, 16, 17, 19]",
        "s0:1[0, 2, 3, 4, 5, 6, 7, 11, 13]",
        "s1:1[0, 2]",
        "s2:1[0, 2, 5]",
        "s0:37[33, 36, 38]",
    ],
]


def _rowid(database: SQLiteDatabase, record_id: str) -> int | None:
    found = (
        database.connection()
        .execute("SELECT rowid FROM memory_records WHERE id = ?", (record_id,))
        .fetchone()
    )
    return None if found is None else int(found[0])


def test_a_search_tops_its_vector_index_up_once(database: SQLiteDatabase) -> None:
    memory = Memory(SQLiteMemoryStore(database), embedder=HashingEmbedder(dimension=256))
    memory.add_many(
        [
            {"text": f"Ada saw the red kite {where}", "session_id": where}
            for where in ("at dawn", "over the hill", "by the river", "in the storm")
        ],
        scope=_ADA,
    )
    memory.flush()
    read: list[str] = []
    database.connection().set_trace_callback(read.append)
    hits = memory.search("the red kite", scope=_ADA, now=_NOW)
    database.connection().set_trace_callback(None)
    assert len(hits) == 4  # the test means something: MMR compared their vectors
    assert len([sql for sql in read if "FROM memory_vectors" in sql]) == 1
    memory.close()


def test_a_vector_written_after_the_index_was_read_is_still_found(
    database: SQLiteDatabase,
) -> None:
    memory = Memory(SQLiteMemoryStore(database), embedder=HashingEmbedder(dimension=256))
    first = memory.add("Ada's red kite", scope=_ADA)
    memory.flush()
    assert memory.search("red kite", scope=_ADA, now=_NOW)  # the index holds the first
    later = memory.add("Ada's blue kite", scope=_ADA)
    memory.flush()
    vectors = memory.store.vectors(_ADA, [first.id, later.id], "keel-hashing-256")
    assert set(vectors) == {first.id, later.id}
    memory.close()


def test_the_nearest_ids_check_leaves_out_a_deleted_record_whose_rowid_is_anothers_now(
    database: SQLiteDatabase,
) -> None:
    memory = Memory(SQLiteMemoryStore(database), embedder=HashingEmbedder(dimension=256))
    kept = memory.add("the red kite flies high", scope=_ADA)
    gone = memory.add("the blue boat sails far", scope=_ADA)
    memory.flush()
    boat = memory.embedder.embed_one("blue boat")  # type: ignore[union-attr]
    search = lambda: memory.store.vector_search(  # noqa: E731
        _ADA, boat, "keel-hashing-256", MemoryFilter(), 5
    )
    assert search()[0].record_id == gone.id  # the index holds the boat, and its rowid
    old_rowid = _rowid(database, gone.id)
    assert memory.forget(_ADA, gone.id)
    stone = memory.add("grey stones lie still", scope=_ADA)  # not embedded: no vector
    assert _rowid(database, stone.id) == old_rowid  # the test means something
    assert [hit.record_id for hit in search()] == [kept.id]
    memory.close()


def test_a_record_stored_again_under_its_id_passes_the_nearest_ids_check(
    database: SQLiteDatabase,
) -> None:
    memory = Memory(SQLiteMemoryStore(database), embedder=HashingEmbedder(dimension=256))
    boat = memory.add("the blue boat sails far", scope=_ADA)
    memory.add("the red kite flies high", scope=_ADA)
    memory.flush()
    query = memory.embedder.embed_one("blue boat")  # type: ignore[union-attr]
    search = lambda: memory.store.vector_search(  # noqa: E731
        _ADA, query, "keel-hashing-256", MemoryFilter(), 5
    )
    assert search()[0].record_id == boat.id
    old_rowid = _rowid(database, boat.id)
    assert memory.forget(_ADA, boat.id)
    memory.store.insert_many([boat])  # the same record, its vector not written again yet
    assert _rowid(database, boat.id) != old_rowid  # the test means something
    assert search()[0].record_id == boat.id  # as the check by id found it
    memory.close()


_RECORD = MemoryRecord(
    id="r",
    tenant_id="default",
    user_id="ada",
    kind="episodic",
    type="note",
    text="a note",
    provenance="user_claim",
    created_at=_NOW,
    content_hash="h",
)


def test_candidates_rank_best_score_first_and_equal_scores_by_id() -> None:
    """The ranking's order of its fused candidates (and the expansion's best few), made by
    two sorts in C: the order of one sort by ``(-score, id)``, ties included (reciprocal
    ranks tie often: a keyword-only and a vector-only candidate at one rank)."""
    rng = random.Random(64)
    for _ in range(500):
        count = rng.randint(0, 300)
        scores = {
            f"{rng.getrandbits(40):010x}": rng.choice((1 / 11, 1 / 12, 0.0, -0.0, rng.random()))
            for _ in range(count)
        }
        assert by_score(scores) == sorted(scores, key=lambda i: (-scores[i], i))
        # The ranked candidates (records read, scores boosted), the same way.
        hits = [
            _Ranked(_RECORD.model_copy(update={"id": record_id}), score, None, None, None, None)
            for record_id, score in scores.items()
        ]
        expected = sorted(hits, key=lambda h: (-h.score, h.record.id))
        best_first(hits)
        assert [h.record.id for h in hits] == [h.record.id for h in expected]


def test_fusion_weighs_each_list_with_its_own_weight_and_floor(database: SQLiteDatabase) -> None:
    """Reciprocal-rank fusion with weights that differ (the defaults are both 1): each list's
    ranks by its own weight, a vector-only candidate under the similarity floor left out
    (though its rank and similarity are kept), one found by both summed."""
    config = RetrievalConfig(keyword_weight=0.7, vector_weight=1.3, rrf_k=5.0, min_similarity=0.2)
    retriever = Retriever(SQLiteMemoryStore(database), None, None, config, print)
    keyword = [ScoredId("a", 3.0), ScoredId("b", 2.0), ScoredId("e", 1.0)]
    vector = [ScoredId("b", 0.9), ScoredId("c", 0.5), ScoredId("d", 0.1), ScoredId("e", 0.05)]
    fused = retriever._fuse(keyword, vector)
    assert fused.scores == {
        "a": 0.7 / 6,
        "b": 0.7 / 7 + 1.3 / 6,
        "e": 0.7 / 8 + 1.3 / 9,
        "c": 1.3 / 7,
    }
    assert fused.keyword_rank == {"a": 1, "b": 2, "e": 3}
    assert fused.vector_rank == {"b": 1, "c": 2, "d": 3, "e": 4}
    assert fused.similarity == {"b": 0.9, "c": 0.5, "d": 0.1, "e": 0.05}


@pytest.mark.parametrize("dimension", [64, 256, 384])
def test_similarity_rows_are_the_rows_of_the_whole_product(dimension: int) -> None:
    rng = np.random.default_rng(dimension)
    vectors = rng.normal(size=(40, dimension)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    whole = np.einsum("ik,jk->ij", vectors, vectors)
    rows = _SimilarityRows(vectors)
    for index in rng.permutation(40):
        assert np.array_equal(rows[int(index)], whole[index]), index
    assert rows.dtype == np.float32


def test_a_filter_made_once_still_reads_the_clock_for_expiry(
    database: SQLiteDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    memory = Memory(SQLiteMemoryStore(database))
    memory.add("Ada's parking permit", scope=_ADA, expires_at=_NOW)
    clock = {"now": _NOW - timedelta(minutes=1)}

    class _Clock(datetime):
        @classmethod
        def now(cls, tz: object = None) -> datetime:  # type: ignore[override]
            return clock["now"]

    monkeypatch.setattr("keel.memory._rows.datetime", _Clock)
    current = MemoryFilter()  # one filter object, its SQL made once
    assert len(memory.search("parking permit", scope=_ADA, filters=current)) == 1
    clock["now"] = _NOW + timedelta(minutes=1)
    assert memory.search("parking permit", scope=_ADA, filters=current) == []
    memory.close()
