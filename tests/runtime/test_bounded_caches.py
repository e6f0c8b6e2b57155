"""The bounded caches a memory-on turn fills drop their oldest entry in one step.

A late turn of a long session meets these caches full: the masker's results (2,048 texts), a
tracer's redaction memo (1,024), the embedder's query vectors (256), and later the token
counter's and the record cache's. A plain dict's oldest entry is found by walking past every
slot its earlier drops emptied (``next(iter(d))``), so each drop cost about a thousand slots'
walk and the turn grew with the session. Each cache is now an ``OrderedDict`` that drops its
oldest (``popitem(last=False)``), never walking it: the tests hand each cache one whose
``__iter__`` fails, fill it past its bound, and check what it kept, oldest dropped first, as
before.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pytest

import keel.privacy._masker as masker_module
import keel.tokens._chat as chat_module
import keel.tracing._redact as redact_module
from keel.memory import HashingEmbedder
from keel.memory._embedders import _RecentVectors
from keel.memory._records import MemoryRecord
from keel.memory._rows import RecordCache, record_to_row
from keel.privacy import PIIMasker
from keel.tokens import ChatTokenCounter, counter_for
from keel.tracing._redact import RedactionMemo


class _NoWalk(OrderedDict[Any, Any]):
    """A cache that fails when walked: a drop must not look for its oldest entry by
    iterating (``next(iter(cache))``)."""

    def __iter__(self) -> Any:
        raise AssertionError("the cache was walked to find its oldest entry")


def test_the_maskers_results_drop_the_oldest_text_without_walking(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(masker_module, "_CACHED_RESULTS", 3)
    masker = PIIMasker()
    policy = masker.policy_for(None)
    results = _NoWalk()
    masker._results[id(policy)] = (policy, results)
    for i in range(6):
        assert masker.mask_text(f"text {i} for bob@example.com") == f"text {i} for <EMAIL_1>"
    assert list(OrderedDict(results)) == [f"text {i} for bob@example.com" for i in (3, 4, 5)]


def test_a_redaction_memo_drops_the_oldest_text_without_walking(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(redact_module, "_MEMO_TEXTS", 3)
    masker = PIIMasker()
    memo = RedactionMemo(functools.partial(masker.mask_text, tenant_id="acme"))
    clean = _NoWalk()
    memo._clean.kept, memo._clean.policy = clean, masker.policy_for("acme")
    redact = memo.current()
    for i in range(6):
        assert redact(f"plain text {i}") == f"plain text {i}"
    assert list(OrderedDict(clean)) == [f"plain text {i}" for i in (3, 4, 5)]


def test_the_token_counters_caches_drop_their_oldest_without_walking(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(chat_module, "_CACHED_TEXTS", 3)
    shared = counter_for("gpt-4o")
    counter = ChatTokenCounter(shared.profile, shared.tokenizer)
    texts = _NoWalk()
    counter._text_counts = texts
    expected = [counter.tokenizer.count(f"words number {i}") for i in range(6)]
    assert [counter.count_text(f"words number {i}") for i in range(6)] == expected
    assert list(OrderedDict(texts)) == [f"words number {i}" for i in (3, 4, 5)]


def test_the_record_cache_drops_the_oldest_row_without_walking() -> None:
    cache = RecordCache(size=3)
    cache._records = _NoWalk()
    rows = [
        record_to_row(
            MemoryRecord(
                id=f"{i:032x}",
                tenant_id="acme",
                user_id="u1",
                kind="episodic",
                text=f"User: turn {i}",
                provenance="user_claim",
                created_at=datetime(2026, 12, 7, tzinfo=UTC),
                content_hash=f"h{i}",
            )
        )
        for i in range(6)
    ]
    built = [cache.record(row) for row in rows]
    assert [record.text for record in built] == [f"User: turn {i}" for i in range(6)]
    assert list(OrderedDict(cache._records)) == rows[3:]
    assert cache.record(rows[5]) is built[5]  # kept: the same record, not built again
    assert cache.built == 6


def test_the_embedders_recent_vectors_drop_the_least_recent_without_walking() -> None:
    embedder = HashingEmbedder(16)
    recent = _RecentVectors(3)
    recent._vectors = _NoWalk()
    for text in ("a", "b", "c"):
        recent.vector(text, embedder.embed)
    again = recent.vector("a", embedder.embed)  # used again: the most recent now
    recent.vector("d", embedder.embed)  # "b" is the least recent, and goes
    assert list(OrderedDict(recent._vectors)) == ["c", "a", "d"]
    assert recent.computed == 4
    assert np.array_equal(again, embedder.embed(["a"])[0])
