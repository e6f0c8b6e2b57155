"""A recall's MMR step with ``mmr_lambda`` 1 (the default: redundancy weighs nothing) picks its
hits in plain Python (issue 47, a memory-on turn): the array steps cost a dozen numpy calls a
pick over forty candidates. The picks, and their order, are the array steps' picks: the same
arithmetic, the first of equals, a near-duplicate compared at the similarities' precision (a
float32 similarity against a threshold that float32 rounds down), the session spread of a
broad question. Seen through an Agent's turn, where both are computed and compared, and over
generated candidates where ties and threshold-exact similarities are made on purpose.

A search's settings for the question's shape are made once per configuration; a retriever
given another configuration searches with that one's.
"""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np
import pytest

from keel.context._engine import MEMORIES_HEADING
from keel.memory import HashingEmbedder, Memory, MemoryHit, RetrievalConfig, Scope
from keel.memory._records import MemoryRecord
from keel.memory._retrieval import Retriever
from keel.messages import Message
from keel.stores import SQLiteDatabase, SQLiteMemoryStore
from keel.testing import ScriptedModel
from tests.runtime.conftest import sqlite_agent

_ADA = Scope(tenant_id="default", user_id="ada")
_T0 = datetime(2026, 1, 5, tzinfo=UTC)


def _recalled(prompt: list[Message]) -> str:
    return next(
        (m.content for m in prompt if m.role == "system" and MEMORIES_HEADING in m.content), ""
    )


async def test_a_turns_recall_picks_what_the_array_steps_pick(
    database: SQLiteDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    memory = Memory(SQLiteMemoryStore(database), embedder=HashingEmbedder(dimension=512))
    # Four earlier sessions about the same boxes, and a near-copy of one of their turns in
    # a fifth (the same words, punctuation aside: cosine 1), which a recall picks once.
    boxes = [("blue", "screws", 4), ("red", "nails", 7), ("green", "bolts", 2), ("blue", "tape", 9)]
    entries = [
        {
            "text": f"Ada's {colour} box of {item} sits on shelf {shelf}, noted in week {week}.",
            "session_id": f"week-{week}",
            "turn": turn,
            "event_time": _T0 + timedelta(days=7 * week, minutes=turn),
        }
        for week in range(4)
        for turn, (colour, item, shelf) in enumerate(boxes)
    ]
    copy = "Ada's blue box of screws sits on shelf 4, noted in week 0!"
    entries.append({"text": copy, "session_id": "week-9", "turn": 0})
    memory.add_many(entries, scope=_ADA)
    memory.flush()
    compared: list[tuple[list[str], list[int], list[int]]] = []
    fast = Retriever._by_relevance

    def both(self: Retriever, hits: list[MemoryHit], similarity: Any, keep: int) -> list[int]:
        picked = fast(self, hits, similarity, keep)
        texts = [hits[i].record.text for i in picked]
        compared.append((texts, picked, self._by_mmr(hits, similarity, keep)))
        return picked

    monkeypatch.setattr(Retriever, "_by_relevance", both)
    model = ScriptedModel(["Noted."])
    agent = sqlite_agent(database, model, memory=memory)
    # Broad (no "did", no date): past the best four, hits spread over sessions.
    await agent.handle("now", "ada", "Which boxes does Ada keep, blue or red, on which shelf?")
    # The test means something: the turn's recall picked past the spread's first four, and
    # of the near-copies it picked one.
    ((texts, picked, arrays),) = compared
    assert len(picked) > 4
    copies = [text for text in texts if text.startswith("Ada's blue box of screws")]
    assert len([text for text in copies if "week 0" in text]) == 1, texts
    assert picked == arrays
    recalled = _recalled(model.calls[-1].messages)
    assert texts[0] in recalled
    await agent.aclose()
    memory.close()


def _hit(index: int, score: float, session: str | None) -> MemoryHit:
    record = MemoryRecord(
        id=f"r{index:03d}",
        tenant_id="t",
        user_id="u",
        kind="episodic",
        type="note",
        text=f"note {index}",
        provenance="user_claim",
        session_id=session,
        turn=index,
        created_at=_T0,
        content_hash=f"h{index}",
    )
    return MemoryHit(record=record, score=score)


@pytest.mark.parametrize("ranked", [False, True], ids=["any-order", "best-first"])
def test_plain_picks_equal_the_array_picks_on_ties_and_threshold_exact_similarities(
    database: SQLiteDatabase, ranked: bool
) -> None:
    """``best-first``: candidates as the ranking hands them over (best score first, where the
    plain picks skip their pass over the candidates while no session spread applies)."""
    store = SQLiteMemoryStore(database)
    rng = random.Random(47)
    mismatches = []
    for case in range(300):
        count = rng.randint(2, 40)
        # Scores from a few values: equal relevance is common, and the first of equals wins.
        scores = [rng.choice((0.5, 0.25, 0.125, rng.random())) for _ in range(count)]
        if ranked:
            scores.sort(reverse=True)
        sessions = [rng.choice((None, "s0", "s1", "s2")) for _ in range(count)]
        hits = [_hit(i, scores[i], sessions[i]) for i in range(count)]
        duplicate = rng.choice((0.9, 0.97))  # float32 rounds 0.9 down and 0.97 up
        exact = float(np.float32(duplicate))
        similarity = rng.choice((0.0, 0.5)) * np.ones((count, count), dtype=np.float32)
        for _ in range(count):
            a, b = rng.randrange(count), rng.randrange(count)
            value = rng.choice((exact, float(np.nextafter(np.float32(exact), 0)), 1.0, 0.3))
            similarity[a, b] = similarity[b, a] = value
        np.fill_diagonal(similarity, 1.0)
        config = RetrievalConfig(
            duplicate_similarity=duplicate,
            session_spread=rng.choice((0.0, 0.9)),
            spread_after=rng.choice((0, 2)),
        )
        retriever = Retriever(store, None, None, config, print)
        keep = rng.choice((3, 10, 40))
        plain = retriever._by_relevance(hits, similarity, keep)
        arrays = retriever._by_mmr(hits, similarity, keep)
        if plain != arrays:
            mismatches.append((case, plain, arrays))
    assert not mismatches, mismatches[:3]


def test_a_retriever_given_another_configuration_searches_with_its_shape_settings(
    database: SQLiteDatabase,
) -> None:
    memory = Memory(SQLiteMemoryStore(database), embedder=HashingEmbedder(dimension=512))
    memory.add_many(
        [
            {"text": text, "session_id": "s1", "turn": turn}
            for turn, text in enumerate(
                [
                    "Ada keeps the spare keys in the kitchen drawer.",
                    "The weather was grey all week.",
                    "The drawer also holds the torch.",
                    "Lunch was soup.",
                    "Ada's keys have a red tag.",
                ]
            )
        ],
        scope=_ADA,
    )
    memory.flush()
    question = "Where does Ada keep her keys?"  # broad: reach 8 shows well-ranked turns near
    wide = memory.search(question, scope=_ADA, k=1)
    assert len(wide[0].records) > 1  # the test means something: the reach widened the block
    memory.retriever.config = RetrievalConfig(broad_reach=0, neighbours=0)
    narrow = memory.search(question, scope=_ADA, k=1)
    assert [r.id for r in narrow[0].records] == [wide[0].record.id]
    memory.close()
