"""Retrieval and ranking: the read path of ``Memory``.

Exact look-ups (profile facts, recent actions), then keyword + vector candidates fused by
weighted reciprocal rank, a calibrated similarity floor, recency weighting, de-duplication /
MMR and neighbouring turns. What a prompt gets is a `RetrievalDraft`, which the model
judge (when there is one) filters and which is then packed into an exact token budget.
"""

from __future__ import annotations

import copy
import itertools
import logging
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from keel._bridge import Forked, fork
from keel.errors import KeelError, UsageError
from keel.memory._config import RetrievalConfig
from keel.memory._embedders import Embedder
from keel.memory._expansion import entity_terms
from keel.memory._packing import PackedMemory, label_for, pack_items
from keel.memory._records import RUN_TYPE, MemoryFilter, MemoryRecord, Scope, mask_text, utcnow
from keel.memory._shape import broad_question, settings_for_shape
from keel.memory._similarity import FloatArray, row_dots
from keel.memory._store import MemoryStore, ScoredId
from keel.memory._temporal import TimeRange, time_ranges
from keel.memory._text import keyword_terms, word_set
from keel.privacy import PIIMasker
from keel.tokens import ChatTokenCounter

__all__ = ["RUN_TYPE", "MemoryHit", "RetrievalDraft", "Retriever"]

logger = logging.getLogger("keel.memory")

# The profile's filter, made once (a frozen model): a prompt's recall reads the profile.
_PROFILE = MemoryFilter(kinds=("semantic",))


def by_score(scores: dict[str, float]) -> list[str]:
    """The ids of ``scores``, best score first, equal scores by id: the order of
    ``sorted(scores, key=lambda i: (-scores[i], i))``, in two sorts that run in C (by id,
    then by score, descending; a sort is stable with ``reverse`` too, so equal scores keep
    their ids' order). About a quarter of the lambda's cost over 200 candidates, and less
    than `heapq.nsmallest`'s Python loop for the best three."""
    return sorted(sorted(scores), key=scores.__getitem__, reverse=True)


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


@dataclass(frozen=True)
class RetrievalDraft:
    """What a retrieval for a prompt read (profile facts, search hits, recent actions),
    before the model judge picks among the hits and the whole is packed."""

    budget_tokens: int
    k: int
    judge_candidates: int
    hits: list[MemoryHit]
    facts: list[MemoryRecord] = field(default_factory=list)
    actions: list[MemoryRecord] = field(default_factory=list)

    def to_judge(self) -> list[str]:
        """The candidates the judge sees, rendered (empty: there is nothing to judge)."""
        return [hit.render() for hit in self.hits[: self.judge_candidates]]

    def pack(self, kept: Sequence[int] | None, counter: ChatTokenCounter) -> PackedMemory:
        """Profile facts, then the hits (only those at ``kept`` of the judged candidates when
        a judge answered) by relevance, then recent actions, within the budget."""
        hits = self.hits
        if kept is not None:
            shown = hits[: self.judge_candidates]
            hits = [shown[i] for i in kept]
        candidates: list[tuple[str, str, tuple[str, ...], float]] = [
            ("profile", f"{label_for(r)} {r.text}", (r.id,), math.inf) for r in self.facts
        ]
        for hit in hits[: self.k]:
            candidates.append(
                ("relevant", hit.render(), tuple(r.id for r in hit.records), hit.score)
            )
            if len(hit.records) > 1:
                # A block too big for what is left of the budget is shown as its hit alone.
                alone = f"{label_for(hit.record)} {hit.record.text}"
                candidates.append(("relevant", alone, (hit.record.id,), hit.score))
        candidates.extend(
            ("recent", f"{label_for(r)} {r.text}", (r.id,), 0.0) for r in self.actions
        )
        return pack_items(candidates, self.budget_tokens, counter)


@dataclass(slots=True)
class _Ranked:
    """A candidate as the ranking scored it: what its `MemoryHit` will hold. Only the hits a
    search returns become `MemoryHit` (validated, about 4 us each); the forty candidates MMR
    and the neighbouring turns look at stay these."""

    record: MemoryRecord
    score: float
    keyword_rank: int | None
    vector_rank: int | None
    similarity: float | None
    recency_boost: float | None

    def hit(self, context: tuple[MemoryRecord, ...]) -> MemoryHit:
        """The search result, with ``context`` (the record with its neighbouring turns)."""
        return MemoryHit(
            record=self.record,
            score=self.score,
            keyword_rank=self.keyword_rank,
            vector_rank=self.vector_rank,
            similarity=self.similarity,
            recency_boost=self.recency_boost,
            context=context,
        )


_record_id = operator.attrgetter("record.id")
_score = operator.attrgetter("score")


def best_first(hits: list[_Ranked]) -> None:
    """Sort ``hits`` as ``hits.sort(key=lambda h: (-h.score, h.record.id))`` does, in two
    sorts in C (as `by_score`)."""
    hits.sort(key=_record_id)
    hits.sort(key=_score, reverse=True)


class _Scored(Protocol):
    """A candidate MMR picks among: a `_Ranked`, or a `MemoryHit`."""

    @property
    def record(self) -> MemoryRecord: ...

    @property
    def score(self) -> float: ...


class _SimilarityRows:
    """The pairwise similarity of a search's candidates, row by row as MMR asks for them: a
    search picks about ten of forty candidates, so about ten rows of the forty are needed.
    A row is the row of the whole product (``gram``): the same dot products, summed in the
    same order."""

    def __init__(self, vectors: FloatArray) -> None:
        self.vectors = vectors
        self.dtype = vectors.dtype
        self._rows: dict[int, FloatArray] = {}

    def __getitem__(self, index: int) -> FloatArray:
        row = self._rows.get(index)
        if row is None:
            row = self._rows[index] = row_dots(self.vectors, self.vectors[index])
        return row


@dataclass
class _Fused:
    """Candidates fused by weighted reciprocal rank, with how each one ranked."""

    scores: dict[str, float] = field(default_factory=dict)
    keyword_rank: dict[str, int] = field(default_factory=dict)
    vector_rank: dict[str, int] = field(default_factory=dict)
    similarity: dict[str, float] = field(default_factory=dict)


class Retriever:
    """Searches a memory store and reads what a prompt gets from it.

    Args:
        store: the store searched.
        embedder: embeds queries; None searches by keyword only.
        masker: masks a query as records were masked when written.
        config: retrieval settings.
        on_error: told the message of a query embedding that failed (``Memory.last_error``).
    """

    def __init__(
        self,
        store: MemoryStore,
        embedder: Embedder | None,
        masker: PIIMasker | None,
        config: RetrievalConfig,
        on_error: Callable[[str], None],
    ) -> None:
        self.store = store
        self.embedder = embedder
        self.masker = masker
        self.config = config
        self._on_error = on_error
        # Each question shape's settings, with the configuration they were made from.
        self._shapes: dict[bool, tuple[RetrievalConfig, RetrievalConfig]] = {}

    # --- exact tier -------------------------------------------------------------------------

    def profile(self, scope: Scope, *, limit: int = 50) -> list[MemoryRecord]:
        """Current semantic facts and preferences of the user, newest first."""
        return self.store.list_records(scope, _PROFILE, limit=limit)

    def recent(
        self, scope: Scope, *, limit: int = 10, types: Sequence[str] = ()
    ) -> list[MemoryRecord]:
        """The last ``limit`` episodic records (optionally of some types), newest first."""
        return self.store.list_records(
            scope,
            MemoryFilter(kinds=("episodic",), types=tuple(types), exclude_types=(RUN_TYPE,)),
            limit=limit,
        )

    # --- for a prompt -----------------------------------------------------------------------

    def draft(
        self,
        query: str,
        scope: Scope,
        budget_tokens: int,
        k: int,
        include_profile: bool,
        recent: int,
        filters: MemoryFilter | None,
        now: datetime | None,
        judged: bool,
    ) -> RetrievalDraft:
        """Everything a retrieval reads, in one blocking call; ``judged``: a judge will pick
        among the best ``judge_candidates`` hits, so that many are searched for.

        Raises:
            UsageError: a negative budget.
        """
        if budget_tokens < 0:
            raise UsageError("budget_tokens must be >= 0")
        wanted = max(k, self.config.judge_candidates) if judged else k
        return RetrievalDraft(
            budget_tokens=budget_tokens,
            k=k,
            judge_candidates=self.config.judge_candidates,
            hits=self.search(query, scope, wanted, filters, now, True),
            facts=self.profile(scope) if include_profile else [],
            actions=self.recent(scope, limit=recent) if recent else [],
        )

    # --- search -----------------------------------------------------------------------------

    def search(
        self,
        query: str,
        scope: Scope,
        k: int,
        filters: MemoryFilter | None,
        now: datetime | None,
        distinct: bool,
    ) -> list[MemoryHit]:
        """What ``Memory.search`` answers (its arguments, by position)."""
        # One clock reading and one reading of the query's dates serve its shape and its
        # ranking alike.
        reference = now or utcnow()
        ranges = time_ranges(query, reference) if self._reads_dates() else []
        shaped = self._shaped(query, ranges)
        if shaped is not self.config:
            # The settings the question's shape gets, for this search only.
            retriever = copy.copy(self)
            retriever.config = shaped
            return retriever._search(query, scope, k, filters, reference, ranges, distinct)
        return self._search(query, scope, k, filters, reference, ranges, distinct)

    def _reads_dates(self) -> bool:
        """Whether a search reads the dates its query names (for its shape or its ranking)."""
        cfg = self.config
        shape = cfg.narrow_context_hits or cfg.broad_reach or cfg.broad_spread
        return bool(shape or cfg.temporal_weight > 0)

    def _shaped(self, query: str, ranges: Sequence[TimeRange]) -> RetrievalConfig:
        """``shaped_config`` of the query, each shape's settings made once per configuration
        (not copied again for every search)."""
        config = self.config
        if not (config.narrow_context_hits or config.broad_reach or config.broad_spread):
            return config
        broad = broad_question(query, ranges)
        cached = self._shapes.get(broad)
        if cached is None or cached[0] is not config:
            cached = (config, settings_for_shape(config, broad))
            self._shapes[broad] = cached
        return cached[1]

    def _search(
        self,
        query: str,
        scope: Scope,
        k: int,
        filters: MemoryFilter | None,
        reference: datetime,
        ranges: Sequence[TimeRange],
        distinct: bool,
    ) -> list[MemoryHit]:
        """`search` with its settings shaped, at ``reference`` (the query names ``ranges``)."""
        filters = filters or MemoryFilter(exclude_types=(RUN_TYPE,))
        # MMR picks the k hits from the best ``window`` candidates; only those are read back.
        window = max(k * 4, 40)
        ranked = self._rank(query, scope, filters, reference, ranges, window=window)
        nearby = ranked[:window] if self.config.context_reach else []
        if not distinct:
            return self._finish(ranked[:k], scope, k, filters, nearby)
        diverse = self._diversify(ranked[:window], scope, keep=k)
        return self._finish(diverse, scope, k, filters, nearby)

    def _rank(
        self,
        query: str,
        scope: Scope,
        filters: MemoryFilter,
        reference: datetime,
        ranges: Sequence[TimeRange],
        *,
        window: int,
    ) -> list[_Ranked]:
        """Fused candidates, best first: at least the best ``window`` of them (when there are
        that many), each with its record."""
        masked = mask_text(self.masker, query, scope.tenant_id)
        keyword, vector = self._candidates(masked, scope, filters)
        fused = self._fuse(keyword, vector)
        if not fused.scores:
            return []
        cfg = self.config
        seeds: list[MemoryRecord] = []
        if cfg.expansion_weight > 0 and cfg.keyword_weight > 0:
            seeds = self._expand(fused, masked, scope, filters)
        if cfg.temporal_weight <= 0:
            ranges = []
        dated = 1.0 + cfg.temporal_weight if ranges else 1.0
        records = self._fetch_reachable(scope, filters, fused.scores, window, dated, seeds)
        hits: list[_Ranked] = []
        for record_id, record in records.items():
            score = fused.scores[record_id]
            boost = None
            if cfg.recency_weight > 0:
                age_days = max(0.0, (reference - record.when).total_seconds() / 86400)
                boost = 1.0 + cfg.recency_weight * math.pow(
                    0.5, age_days / cfg.recency_half_life_days
                )
                score *= boost
            if ranges and any(span.contains(record.when) for span in ranges):
                score *= dated
            hits.append(
                _Ranked(
                    record,
                    score,
                    fused.keyword_rank.get(record_id),
                    fused.vector_rank.get(record_id),
                    fused.similarity.get(record_id),
                    boost,
                )
            )
        best_first(hits)
        return hits

    def _candidates(
        self, masked_query: str, scope: Scope, filters: MemoryFilter
    ) -> tuple[list[ScoredId], list[ScoredId]]:
        """Keyword and vector candidates of the (masked) query."""
        cfg = self.config
        terms = keyword_terms(masked_query)
        use_keywords = bool(terms) and cfg.keyword_weight > 0
        embedder = self.embedder if cfg.vector_weight > 0 else None
        if embedder is None:
            if not use_keywords:
                return [], []
            return self.store.keyword_search(scope, terms, filters, cfg.candidates), []
        # The keyword query runs while the query is embedded and the vectors scanned:
        # SQLite, ONNX Runtime and numpy all release the GIL, so the two overlap. Unless
        # there is nothing to overlap: an embedded store with a query vector that costs
        # nothing runs both here (the thread switch would cost more than it saves).
        pending: Forked[list[ScoredId]] | None = None
        overlap = self.store.concurrent_searches or not (
            embedder.cheap_queries or embedder.has_query(masked_query)
        )
        if use_keywords and overlap:
            pending = fork(self.store.keyword_search, scope, terms, filters, cfg.candidates)
        keyword: list[ScoredId] = []
        if use_keywords and pending is None:
            keyword = self.store.keyword_search(scope, terms, filters, cfg.candidates)
        vector: list[ScoredId] = []
        try:
            query_vector = embedder.embed_one(masked_query)
        except KeelError as exc:
            # A down embedding endpoint degrades search to keyword-only, never fails it.
            self._on_error(str(exc))
            logger.warning("query embedding failed, keyword search only: %s", exc)
        else:
            vector = self.store.vector_search(
                scope, query_vector, embedder.name, filters, cfg.candidates
            )
        return (keyword if pending is None else pending.join()), vector

    def _fuse(self, keyword: list[ScoredId], vector: list[ScoredId]) -> _Fused:
        """Weighted reciprocal rank over both lists; a vector-only candidate under the
        similarity floor is dropped."""
        cfg = self.config
        fused = _Fused()
        # Locals in the loops (~200 candidates a late recall): the same arithmetic.
        scores, keyword_rank = fused.scores, fused.keyword_rank
        vector_rank, similarity = fused.vector_rank, fused.similarity
        weight, rrf_k, floor = cfg.keyword_weight, cfg.rrf_k, cfg.min_similarity
        for rank, hit in enumerate(keyword, start=1):
            keyword_rank[hit.record_id] = rank
            scores[hit.record_id] = weight / (rrf_k + rank)
        weight = cfg.vector_weight
        for rank, hit in enumerate(vector, start=1):
            record_id, score = hit.record_id, hit.score
            vector_rank[record_id] = rank
            similarity[record_id] = score
            if record_id not in keyword_rank and score < floor:
                continue
            scores[record_id] = scores.get(record_id, 0.0) + (weight / (rrf_k + rank))
        return fused

    def _expand(
        self, fused: _Fused, masked_query: str, scope: Scope, filters: MemoryFilter
    ) -> list[MemoryRecord]:
        """Multi-hop expansion: a keyword search for the names the best ``expansion_seeds``
        candidates mention and the query does not, fused in with ``expansion_weight``. The
        seeds' records, read for their names, are returned: the ranking needs them too."""
        cfg = self.config
        scores = fused.scores
        best = by_score(scores)[: cfg.expansion_seeds]
        seeds = self.store.fetch(scope, best, filters)
        terms = entity_terms([r.text for r in seeds], keyword_terms(masked_query))
        if not terms:
            return seeds
        # The seeds are what the hop starts from: a seed is never lifted by names it
        # mentions itself (a lone hit naming a pet would otherwise climb over the answer).
        starts = {record.id for record in seeds}
        for rank, hit in enumerate(
            self.store.keyword_search(scope, terms, filters, cfg.candidates), start=1
        ):
            if hit.record_id in starts:
                continue
            scores[hit.record_id] = scores.get(hit.record_id, 0.0) + (
                cfg.expansion_weight / (cfg.rrf_k + rank)
            )
        return seeds

    def _fetch_reachable(
        self,
        scope: Scope,
        filters: MemoryFilter,
        scores: dict[str, float],
        window: int,
        dated: float = 1.0,
        read: Sequence[MemoryRecord] = (),
    ) -> dict[str, MemoryRecord]:
        """The records of every candidate that can still finish in the best ``window``
        (``read``: records this search has read already, under the same scope and filters,
        which are not read again).

        Recency multiplies a fused score by a factor in [1, 1 + recency_weight] (and a date
        the query names by one in [1, ``dated``]), so the
        ``window``-th best fused score is a floor under the ``window``-th best final score and
        a candidate whose boosted score stays below it can never enter: its record is not read
        (about 40 records instead of 200). Candidates the store drops (a filter, a concurrent
        delete) are replaced from the rest.
        """
        ordered = by_score(scores)
        boost = (1.0 + self.config.recency_weight) * dated
        known = {record.id: record for record in read}
        records: dict[str, MemoryRecord] = {}
        start = 0
        while start < len(ordered):
            missing = window - len(records)
            floor = scores[ordered[start + missing - 1]] if start + missing <= len(ordered) else 0
            end = start + max(missing, 1)
            while end < len(ordered) and scores[ordered[end]] * boost >= floor:
                end += 1
            wanted = ordered[start:end]
            unread = [record_id for record_id in wanted if record_id not in known]
            fetched = self.store.fetch_by_id(scope, unread, filters) if unread else {}
            # In rank order, as a read of them all would have given them.
            records.update(
                (record_id, record)
                for record_id in wanted
                if (record := known.get(record_id) or fetched.get(record_id)) is not None
            )
            start = end
            if len(records) >= window:
                break
        return records

    def _diversify(self, hits: list[_Ranked], scope: Scope, keep: int) -> list[_Ranked]:
        """``keep`` of ``hits`` without near-duplicates; with ``mmr_lambda`` < 1 picked by MMR."""
        cfg = self.config
        count = len(hits)
        if count <= 1:
            return hits
        similarity = self._similarities(hits, scope)
        pick = self._by_relevance if cfg.mmr_lambda == 1.0 else self._by_mmr
        return [hits[i] for i in pick(hits, similarity, keep)]

    def _by_mmr(self, hits: Sequence[_Scored], similarity: Any, keep: int) -> list[int]:
        """`_diversify`'s picks (positions in ``hits``), by MMR over ``similarity``."""
        cfg = self.config
        count = len(hits)
        relevance = np.array([h.score for h in hits], dtype=np.float64)
        relevance = relevance / max(float(relevance.max()), 1e-12)
        alive = np.ones(count, dtype=bool)
        redundancy = np.zeros(count, dtype=np.float64)
        # Hits already picked from each candidate's session: with ``session_spread`` every
        # one of them discounts the candidate's relevance, so hits spread over sessions.
        sessions = [h.record.session_id for h in hits]
        # Each hit's session as a number (None: -1), so a pick discounts its session's
        # candidates in one comparison, not one per candidate.
        numbers: dict[str, int] = {}
        session_of = np.array(
            [-1 if s is None else numbers.setdefault(s, len(numbers)) for s in sessions],
            dtype=np.int64,
        )
        spread = np.ones(count, dtype=np.float64)
        selected: list[int] = []
        while len(selected) < keep and alive.any():
            spreading = cfg.session_spread > 0 and len(selected) >= cfg.spread_after
            values = (
                cfg.mmr_lambda * relevance * (spread if spreading else 1.0)
                - (1 - cfg.mmr_lambda) * redundancy
            )
            values[~alive] = -np.inf
            chosen = int(np.argmax(values))
            selected.append(chosen)
            alive[chosen] = False
            # Near-duplicates of what was chosen are removed for good.
            alive &= similarity[chosen] < cfg.duplicate_similarity
            redundancy = np.maximum(redundancy, similarity[chosen])
            if cfg.session_spread > 0 and sessions[chosen] is not None:
                spread[session_of == session_of[chosen]] *= 1.0 - cfg.session_spread
        return selected

    def _by_relevance(self, hits: Sequence[_Scored], similarity: Any, keep: int) -> list[int]:
        """`_by_mmr`'s picks with ``mmr_lambda`` 1 (redundancy weighs nothing), in plain
        Python: the same picks in the same order (the same arithmetic, the first of equals,
        a near-duplicate compared at the similarities' precision), without `_by_mmr`'s dozen
        array operations a pick, each dearer than a plain loop over forty candidates."""
        cfg = self.config
        count = len(hits)
        scores = [h.score for h in hits]
        top = max(max(scores), 1e-12)
        relevance = [score / top for score in scores]
        # Compared as the array steps compare: the threshold at the similarities' precision.
        threshold = float(similarity.dtype.type(cfg.duplicate_similarity))
        # Each session's candidates, so a pick discounts its session's only.
        members: dict[str, list[int]] = {}
        if cfg.session_spread > 0:
            for index, hit in enumerate(hits):
                if hit.record.session_id is not None:
                    members.setdefault(hit.record.session_id, []).append(index)
        # Candidates come best first (the ranking's order): then, while no spread discounts
        # them, the first alive is the first of the best and needs no pass over the rest.
        # (A NaN compares false: such a list takes the passes.)
        ranked = all(a >= b for a, b in itertools.pairwise(relevance))
        spread = [1.0] * count
        alive = list(range(count))  # in rank order, as the first of equals wins
        selected: list[int] = []
        while len(selected) < keep and alive:
            spreading = cfg.session_spread > 0 and len(selected) >= cfg.spread_after
            chosen, best = alive[0], -math.inf
            for index in alive if spreading or not ranked else ():
                value = relevance[index] * spread[index] if spreading else relevance[index]
                if value > best:
                    chosen, best = index, value
            selected.append(chosen)
            # Near-duplicates of what was chosen are removed for good.
            row = similarity[chosen].tolist()
            alive = [index for index in alive if index != chosen and row[index] < threshold]
            session = hits[chosen].record.session_id
            if cfg.session_spread > 0 and session is not None:
                factor = 1.0 - cfg.session_spread
                for index in members[session]:
                    spread[index] *= factor
        return selected

    def _similarities(self, hits: list[_Ranked], scope: Scope) -> Any:
        """Pairwise similarity of the hits, by row (``similarity[i]``): cosine of their
        vectors when every hit has one (each row computed when first asked for), else the
        Jaccard overlap of their words."""
        count = len(hits)
        ids = [h.record.id for h in hits]
        vectors: dict[str, Any] = {}
        if self.embedder is not None:
            vectors = self.store.vectors(scope, ids, self.embedder.name)
        if len(vectors) == count:
            stacked = np.stack([np.asarray(vectors[i], dtype=np.float32) for i in ids])
            return _SimilarityRows(stacked)
        words = [word_set(h.record.text) for h in hits]
        similarity = np.zeros((count, count), dtype=np.float32)
        for a in range(count):
            for b in range(a + 1, count):
                union = words[a] | words[b]
                value = len(words[a] & words[b]) / len(union) if union else 0.0
                similarity[a, b] = similarity[b, a] = value
        return similarity

    def _finish(
        self,
        hits: list[_Ranked],
        scope: Scope,
        k: int,
        filters: MemoryFilter,
        nearby: Sequence[_Ranked] = (),
    ) -> list[MemoryHit]:
        """Top ``k`` hits with their neighbouring turns.

        A hit that an earlier hit already shows (as a neighbour) still counts as one of the
        ``k`` and extends that earlier block with its own neighbours, so adjacent hits become
        one contiguous block and no turn is shown twice. ``nearby``: the search's best
        candidates; those of a hit's session within ``context_reach`` turns of it join its
        block (a turn that ranks well on its own is worth showing next to the hit; a turn
        that does not is left out, so the reach costs few tokens).
        """
        reach = self.config.context_reach
        # By session and turn: a hit looks up the few turns it may show, not every candidate
        # and neighbour read (each list keeps its read order: turns_around's, the ranking's).
        close: dict[tuple[str, int], list[MemoryRecord]] = {}
        for candidate in nearby:
            if candidate.record.session_id is not None and candidate.record.turn is not None:
                close.setdefault((candidate.record.session_id, candidate.record.turn), []).append(
                    candidate.record
                )
        owner: dict[str, int] = {}
        # Each block as its hit, its records (in the order they came) and whether a later hit
        # merged into it (then its records are sorted once, at the end: a stable sort of what
        # was sorted before plus what came after is the sort of the whole, so this is the
        # order a sort at each merge gave). A `MemoryHit` is made once a block, not copied at
        # each merge.
        blocks: list[tuple[_Ranked, dict[str, MemoryRecord], bool]] = []
        merged_into: set[int] = set()
        around: dict[tuple[str, int], list[MemoryRecord]] = {}
        for session_id, found in self._turns_around(hits[:k], scope, filters).items():
            for neighbour in found:
                if neighbour.turn is not None:
                    around.setdefault((session_id, neighbour.turn), []).append(neighbour)
        for position, hit in enumerate(hits[:k]):
            span = self._span(position)
            record = hit.record
            turns = _block_turns(record, span, reach, around, close)
            if record.id in owner:
                index = owner[record.id]
                merged = blocks[index][1]
                for turn in turns:
                    if turn.id not in owner:
                        merged[turn.id] = turn
                        owner[turn.id] = index
                merged_into.add(index)
                continue
            fresh = {r.id: r for r in turns if r.id not in owner or r.id == record.id}
            for turn_id in fresh:
                owner[turn_id] = len(blocks)
            blocks.append((hit, fresh, bool(span)))
        finished: list[MemoryHit] = []
        for index, (hit, records, spanned) in enumerate(blocks):
            if index in merged_into:
                ordered = sorted(records.values(), key=lambda r: (r.turn or 0, r.created_at))
                finished.append(hit.hit(tuple(ordered)))
            else:
                finished.append(hit.hit(tuple(records.values()) if spanned else ()))
        return finished

    def _span(self, index: int) -> int:
        """Turns shown on each side of the hit at ``index`` (0-based rank)."""
        cfg = self.config
        # No neighbours means none: ``wide_hits`` widens a context, never creates one.
        if cfg.neighbours == 0 or (cfg.context_hits and index >= cfg.context_hits):
            return 0
        return cfg.neighbours + (1 if index < cfg.wide_hits else 0)

    def _turns_around(
        self, hits: list[_Ranked], scope: Scope, filters: MemoryFilter
    ) -> dict[str, list[MemoryRecord]]:
        """Every hit's neighbouring turns, by session, in one read (not one per hit); none
        that the asking prompt shows (``filters.shown``)."""
        spans = {
            (hit.record.session_id, hit.record.turn - span, hit.record.turn + span)
            for index, hit in enumerate(hits)
            if (span := self._span(index))
            and hit.record.session_id is not None
            and hit.record.turn is not None
        }
        if filters.shown is not None:
            spans = {clipped for span in spans if (clipped := filters.shown.clip(*span))}
        around: dict[str, list[MemoryRecord]] = {}
        for found in self.store.turns_around(scope, sorted(spans)) if spans else ():
            around.setdefault(found.session_id or "", []).append(found)
        return around


def _block_turns(
    record: MemoryRecord,
    span: int,
    reach: int,
    around: dict[tuple[str, int], list[MemoryRecord]],
    close: dict[tuple[str, int], list[MemoryRecord]],
) -> tuple[MemoryRecord, ...]:
    """The turns a hit's block shows: those within ``span`` of it (``around``), widened to
    ``reach`` by the search's own candidates of its session (``close``)."""
    if not span or record.session_id is None or record.turn is None:
        return (record,)
    session_id, turn_of = record.session_id, record.turn
    turns = tuple(
        r
        for turn in range(turn_of - span, turn_of + span + 1)
        for r in around.get((session_id, turn), ())
    ) or (record,)
    # Like ``wide_hits``, the reach widens a context and never creates one.
    if reach > span:
        extra = [
            r
            for distance in range(span + 1, reach + 1)
            for turn in (turn_of - distance, turn_of + distance)
            for r in close.get((session_id, turn), ())
        ]
        if extra:
            joined = {r.id: r for r in (*turns, *extra)}
            turns = tuple(sorted(joined.values(), key=lambda r: (r.turn or 0, r.id)))
    return turns
