"""Which keyword terms to score, so a full-text query's cost stays bounded at any table size.

Ranking (FTS5's bm25(), BM25 computed in SQL on PostgreSQL) costs microseconds per matching
row and is the whole cost of a broad query: four common words can match most of a 100k-row
table. Both stores plan the same way:

0. A term in more than half of the scope's own rows, and in more rows than the search lists,
   says nothing about which of them a query means (``informative_terms``): it is dropped,
   unless every term the scope holds is that common (the rarest is kept).
1. A term found in more than 1/20 of the rows is dropped (the rarest is kept if all are): it
   carries almost no weight (low IDF) and would dominate the cost. SQLite also drops a term
   in more than 20,000 rows, since FTS5's bm25() walks each ranked term's every row.
2. If the remaining terms still match more rows than the budget, every row with one of the
   rarest terms (up to half the budget) is scored, and of the rows that have only commoner
   terms, the newest fill the rest. A broad query prefers recent memories; a specific word
   always finds its rows, however old.

Document frequencies are counted with a bound (``LIMIT cap + 1``), so planning is cheap too;
PostgreSQL reads them from a table its triggers keep (`keel.stores._postgres_terms`), exact,
and bounds them the same way, so both plan alike.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from keel.stores._sql_plan import Plan

__all__ = [
    "AVERAGE_LENGTH_MILLI",
    "SCOPE_ROWS",
    "KeywordPlan",
    "TermFrequencies",
    "common_term_cap",
    "informative_terms",
    "plan_terms",
]

#: Keys of :class:`TermFrequencies` for figures of a scope rather than of one term (a term is
#: one word, never empty and never with a space).
SCOPE_ROWS = ""
AVERAGE_LENGTH_MILLI = " average length x 1000"


def common_term_cap(total_rows: int, most: int | None = None) -> int:
    """Rows above which a term counts as common (and is dropped); never above ``most``
    (when given) once the table is large enough for 1/20 of it to exceed it."""
    cap = max(2000, total_rows // 20)
    return cap if most is None else max(2000, min(cap, most))


def informative_terms(frequency: Mapping[str, int], scope_rows: int, listed: int) -> list[str]:
    """The terms of ``frequency`` (each term's rows in the scope) that tell its rows apart.

    A term in more than half of the scope's rows has a negative BM25 IDF by the scope's own
    figures (``log((N - n + 0.5) / (n + 0.5))``): the speaker's name that opens every turn of
    a conversation, a word a user says in everything. When its rows would also fill the
    ``listed`` ranks the keyword search returns, the rows matching only it take every rank
    after the real matches, each as good as the next, and fusion reads ranks: it is dropped
    from the query. (In a scope that small a list holds, every row is ranked anyway, and a
    shared word still orders them.) When every term the scope holds is that common, the
    rarest is kept, so such a query still finds rows.
    """
    floor = max(scope_rows / 2, listed)
    kept = [term for term in frequency if frequency[term] <= floor]
    if any(frequency[term] for term in kept):
        return kept
    present = [term for term in frequency if frequency[term]]
    return [min(present, key=frequency.__getitem__)] if present else kept


@dataclass(frozen=True)
class KeywordPlan:
    """The terms to match; when ``newest`` > 0, rows with only ``common`` terms are limited
    to the ``newest`` most recent ones, while rows with a ``rare`` term are all scored."""

    terms: list[str]
    rare: list[str] = field(default_factory=list)
    common: list[str] = field(default_factory=list)
    newest: int = 0
    #: Rows in the table when planned.
    total_rows: int = 0
    #: Every term was over the cap: ``terms`` is the rarest alone, and it is common.
    broad: bool = False


def plan_terms(
    frequency: Mapping[str, int], *, cap: int, budget: int, total_rows: int
) -> KeywordPlan:
    """Plan a query from each term's (bounded) document frequency."""
    kept = sorted((t for t in frequency if frequency[t] <= cap), key=frequency.__getitem__)
    broad = not kept
    if broad:
        kept = [min(frequency, key=frequency.__getitem__)]
    if sum(frequency[term] for term in kept) <= budget:
        return KeywordPlan(kept, total_rows=total_rows)
    rare: list[str] = []
    rare_rows = 0
    for term in kept:
        if rare_rows + frequency[term] > budget // 2:
            break
        rare.append(term)
        rare_rows += frequency[term]
    return KeywordPlan(
        kept,
        rare,
        kept[len(rare) :],
        newest=budget - rare_rows,
        total_rows=total_rows,
        broad=broad,
    )


class TermFrequencies:
    """Bounded document counts per (scope, term), reused while they are within 5% of the truth.

    A scope's count can grow by at most as many rows as the whole table did, so a count is
    reused while the table has grown by no more than 5% of it: a common term's count for a
    long time, a rare term's or a small scope's barely at all (they are cheap to count). Counts
    steer the plan (which terms to drop, where the recency floor goes) and weigh terms by IDF;
    a term that comes back in later queries costs nothing. Keys that are not words
    (`SCOPE_ROWS`, `AVERAGE_LENGTH_MILLI`) hold figures of the scope itself.
    A count that stopped at its bound says only that the term has at least that many rows: it
    is not reused for a question with a higher bound (a growing scope raises the half of it
    that `informative_terms` compares with, and a count capped at the old half would keep a
    term in every row as informative).
    A store drops a scope's counts when it deletes rows of it (`forget`): a count is kept
    while the table grows, and says nothing once the rows it counted are gone (an erased
    user's words are not kept either). Rows another process deleted (another worker erased a
    user) are seen in the store's count of deleting transactions (`saw_deletions`): every
    count is made again. A table with fewer rows than when a count was made has lost rows too.
    Safe to share between threads (single dict operations).
    """

    def __init__(self, max_entries: int = 100_000) -> None:
        self.max_entries = max_entries
        # Per scope, per term: (count, table rows when counted, the bound it was counted to
        # or None). By scope, so a scope's counts are dropped at once (`forget`).
        self._counts: dict[tuple[str, str], dict[str, tuple[int, int, int | None]]] = {}
        self._entries = 0  # about how many counts are kept (threads may miss an update)
        # Bumped by every `forget` (next() on a count is one step under the GIL): a count made
        # while rows were deleted may have counted them, and is not kept.
        self._forgets = itertools.count()
        self._forgotten = 0
        self._deletions: int | None = None

    def get(
        self,
        scope: tuple[str, str],
        term: str,
        total_rows: int,
        count: Callable[[str], Plan[int]],
        limit: int | None = None,
    ) -> Plan[int]:
        """The count of ``term`` in ``scope``: the one kept, while it is close enough, else
        what the plan ``count(term)`` counts (a statement of the store's search plan), which
        counts up to ``limit`` rows when given."""
        kept = self._counts.get(scope)
        cached = None if kept is None else kept.get(term)
        if (
            cached is not None
            and 0 <= total_rows - cached[1] <= 0.05 * cached[0]
            and not _capped_below(cached[0], cached[2], limit)
        ):
            return cached[0]
        forgotten = self._forgotten
        value = yield from count(term)
        if self._forgotten != forgotten:
            # Rows were deleted (a user erased, a record forgotten) while this count was made:
            # kept, it would outlive the `forget` meant to drop it, and say what is gone.
            return value
        if self._entries >= self.max_entries:
            self._counts.clear()
            self._entries = 0
        kept = self._counts.setdefault(scope, {})
        if term not in kept:
            self._entries += 1
        kept[term] = (value, total_rows, limit)
        return value

    def forget(self, tenant_id: str | None = None, user_id: str | None = None) -> None:
        """Drop the counts of ``tenant_id``'s scope of ``user_id`` (every user's when None;
        every tenant's when ``tenant_id`` is None too): rows of it were deleted. A count
        being made meanwhile (another thread's search) is not kept either."""
        self._forgotten = next(self._forgets) + 1
        if tenant_id is not None and user_id is not None:
            self._counts.pop((tenant_id, user_id), None)
            return
        for scope in tuple(self._counts):
            if tenant_id in (None, scope[0]) and user_id in (None, scope[1]):
                self._counts.pop(scope, None)

    def saw_deletions(self, deletions: int) -> None:
        """``deletions``: how many transactions ever deleted rows of the table (its store's
        ``memory_deletions``), read with the table's size. A change since the last read says
        that rows went, in this process or another (a worker that erased a user, `keel memory
        prune`), of any scope: every count kept may count them, and is dropped. (The table's
        size, its largest row number, seldom falls when rows are deleted.)"""
        if deletions != self._deletions:
            if self._deletions is not None:
                self.forget()
            self._deletions = deletions

    def known(self, scope: tuple[str, str], term: str) -> int | None:
        """The count of ``term`` in ``scope`` last counted (however old), or None."""
        cached = self._counts.get(scope, {}).get(term)
        return None if cached is None else cached[0]

    def plan(
        self,
        scope: tuple[str, str],
        terms: list[str],
        *,
        total_rows: int,
        scope_rows: int,
        listed: int,
        budget: int,
        count: Callable[[str, int], Plan[int]],
        most_common_rows: int | None = None,
    ) -> Plan[KeywordPlan]:
        """Plan ``terms`` for one scope of ``scope_rows`` rows, for a search listing ``listed``
        rows; ``count(term, limit)`` counts the scope's matching rows up to ``limit``. Only its
        uninformative terms are dropped from a table within the budget: it is ranked in full.
        ``most_common_rows`` caps the rows a kept term may have (see ``common_term_cap``)."""
        unique = list(dict.fromkeys(terms))
        # Counted just past what informative_terms asks: a few doclist entries in a scope
        # this small.
        enough = max(scope_rows // 2, listed) + 1
        if total_rows <= budget:
            small = yield from self._counts_of(
                scope, unique, total_rows, lambda t: count(t, enough), enough
            )
            return KeywordPlan(informative_terms(small, scope_rows, listed), total_rows=total_rows)
        cap = common_term_cap(total_rows, most_common_rows)
        # Past the cap a term is dropped as common: counted no further.
        limit = min(cap + 1, enough)
        frequency = yield from self._counts_of(
            scope, unique, total_rows, lambda t: count(t, limit), limit
        )
        kept = informative_terms(frequency, scope_rows, listed)
        return plan_terms(
            {term: frequency[term] for term in kept}, cap=cap, budget=budget, total_rows=total_rows
        )

    def _counts_of(
        self,
        scope: tuple[str, str],
        terms: list[str],
        total_rows: int,
        count: Callable[[str], Plan[int]],
        limit: int,
    ) -> Plan[dict[str, int]]:
        """`get` of each of ``terms``, each counted up to ``limit``."""
        found: dict[str, int] = {}
        for term in terms:
            found[term] = yield from self.get(scope, term, total_rows, count, limit)
        return found


def _capped_below(value: int, counted_to: int | None, limit: int | None) -> bool:
    """Whether a count of ``value`` made up to ``counted_to`` rows stopped at that bound,
    below the ``limit`` now asked for (so the term may have more rows than it says)."""
    if counted_to is None or limit is None:
        return False
    return value >= counted_to and limit > counted_to
