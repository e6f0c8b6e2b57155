"""PostgreSQL keyword search's ranking: BM25 in SQL over the rows a `KeywordPlan` chooses.

Split from `keel.stores._postgres_memory` (the store): what one ranking statement reads, and
how the newest matches of a broad query's common words are found without reading them all.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from keel.stores._keywords import KeywordPlan
from keel.stores._postgres_search_rows import SEARCH_ROWS
from keel.stores._sql_plan import Plan, Statement

__all__ = ["KeywordStatistics", "keyword_ranking", "with_bitmaps"]

# BM25's parameters, FTS5's defaults: term-frequency saturation and length normalization.
_BM25_K1 = 1.2
_BM25_B = 0.75


@dataclass(frozen=True)
class KeywordStatistics:
    """A keyword query's plan, each planned term's IDF, and the scope's average length."""

    plan: KeywordPlan
    idf: dict[str, float]
    average_length: float
    #: The scope's records, and each planned term's (exact where ``memory_terms`` knows it).
    scope_rows: int = 0
    rows: Mapping[str, int] = field(default_factory=dict)


def _ts_any(terms: Sequence[str]) -> str:
    """A tsquery matching any of ``terms`` (each one a query parameter)."""
    return " || ".join("plainto_tsquery('english', %s)" for _ in terms)


# The newest matches of a broad query's common words are looked for first among the newest
# records: this many times the records that should hold enough of them, so that a guess a
# little off still finds them there (and when it does not, the older records are searched).
_WINDOW_MARGIN = 1.5
# What finding a broad query's newest matches costs, in reads of a heap page at random (the
# unit: every row a bitmap keeps is one), measured at 1M records: a row walked back through
# the seq index from the newest (its neighbours share its page; 1-3 us), an entry of the GIN
# index's bitmap of a word's matches (0.1-0.3 us) and one of the seq index's range (about
# 0.1 us), against 7-10 us a page read at random (most from the OS's cache, not PostgreSQL's).
_WALKED_ROW = 1 / 3
_POSTING = 1 / 40
_RANGE_ENTRY = 1 / 200


def _common_matches(statistics: KeywordStatistics) -> float:
    """Rows of the scope with one of the plan's common terms, were each term's rows spread
    independently over the scope (from the exact counts where ``memory_terms`` has them)."""
    plan = statistics.plan
    scope_rows = max(statistics.scope_rows, 1)
    missing = 1.0
    for term in plan.common:
        missing *= 1 - min(1.0, statistics.rows.get(term, scope_rows) / scope_rows)
    return (1 - missing) * scope_rows


def _walk_cheaper(plan: KeywordPlan, matches: float) -> bool:
    """Whether walking back from the newest record finds ``plan.newest`` of ``matches`` for
    less than reading every match (``matches`` per ``plan.total_rows``)."""
    walked = plan.newest * plan.total_rows / max(matches, 1.0)
    return walked * _WALKED_ROW < matches * (1 + _POSTING)


def _recent_window(statistics: KeywordStatistics, total_rows: int) -> int:
    """How many of the newest sequence numbers should hold ``plan.newest`` rows of the scope
    with a common term, were its rows and each term's spread evenly over the table; 0 when
    reading them there costs more than reading every match, or than walking back from the
    newest record until that many matched (a word in 40% of a million records: its 400,000
    postings took 49 ms to gather for the window, a walk reads about 3,700 rows)."""
    plan = statistics.plan
    matches = _common_matches(statistics)
    # Rows of the scope with a common term, per sequence number of the table.
    density = matches / max(total_rows, 1)
    if density <= 0:
        return 0
    window = math.ceil(_WINDOW_MARGIN * plan.newest / density) + 100
    # The window reads a page a row it keeps, after both indexes' bitmaps; every match
    # costs a page each; a walk reads the rows back to the newest match it needs.
    windowed = _WINDOW_MARGIN * plan.newest + matches * _POSTING + window * _RANGE_ENTRY
    everything = matches * (1 + _POSTING)
    walked = plan.newest / density * _WALKED_ROW
    return window if window < total_rows and windowed < min(everything, walked) else 0


def keyword_ranking(
    statistics: KeywordStatistics, scoped: str, scope_args: tuple[object, ...], limit: int
) -> tuple[Statement, bool]:
    """The statement that ranks a planned keyword query's rows, and whether it looks for the
    newest matches in a window of the newest records (`_chosen_rows_sql`)."""
    plan = statistics.plan
    # BM25 as SQLite's FTS5 computes it (k1 1.2, b 0.75), with each term counted once
    # per record (memories are short) and the IDF of the scope's own rows. PostgreSQL's
    # ts_rank_cd knows no IDF: a name said in every turn weighed as much as the one
    # rare word that finds the answer (LoCoMo R@10 0.744 against 0.770 on SQLite), and
    # it costs 4x more per row.
    matched = " + ".join("%s * (tsv @@ plainto_tsquery('english', %s))::int" for _ in plan.terms)
    weights = statistics.idf
    score = f"({matched}) / (%s + %s * length(tsv))"
    length_norm = _BM25_K1 * _BM25_B / max(statistics.average_length, 1.0)
    score_args = (
        *(value for term in plan.terms for value in (weights[term], term)),
        1 + _BM25_K1 * (1 - _BM25_B),
        length_norm,
    )
    if plan.newest:
        sql, args, windowed = _chosen_rows_sql(
            statistics, score, score_args, scoped, scope_args, limit
        )
        return Statement(sql, args), windowed
    sql = (
        f"WITH q AS (SELECT ({_ts_any(plan.terms)}) AS query) "
        f"SELECT id, {score} AS score FROM {SEARCH_ROWS}, q "
        f"WHERE {scoped} AND tsv @@ q.query ORDER BY score DESC, seq LIMIT %s"
    )
    return Statement(sql, (*plan.terms, *score_args, *scope_args, limit)), False


def with_bitmaps(ranking: Statement) -> Plan[list[Any]]:
    """``ranking`` planned without plain index scans (this transaction's setting alone), so
    the window of newest records and the words' matches meet in a bitmap. Left to itself,
    PostgreSQL read the window's every row through the seq index (records in order on
    disk look cheap to it): 5,626 buffers for 1,472 rows at 100k, where the bitmap reads
    about one page a row it keeps."""
    yield Statement("SELECT set_config('enable_indexscan', 'off', true)")
    return (yield ranking).rows


def _chosen_rows_sql(
    statistics: KeywordStatistics,
    score: str,
    score_args: tuple[object, ...],
    scoped: str,
    scope_args: tuple[object, ...],
    limit: int,
) -> tuple[str, tuple[object, ...], bool]:
    """The ranking of a query over budget: every row with a rare term and the newest with
    only common ones (see `keel.stores._keywords`), each scored as it is read.

    The newest common matches are looked for among the newest records first
    (`_recent_window`): the GIN index's matches and the seq index's range meet in a bitmap,
    so only rows that are both are read, about as many as are ranked. Before, every match
    of the common terms in the table was read (up to 20,000 a term, each a page) to keep
    the newest. The older records are searched only when the recent ones fell short, so the
    rows chosen are exactly the newest matches either way.
    """
    plan = statistics.plan
    common = f"{scoped} AND tsv @@ ({_ts_any(plan.common)})"
    common_args = (*scope_args, *plan.common)
    window = _recent_window(statistics, plan.total_rows)
    # Two ways to find the older matches: walk the seq index backwards testing each row's
    # tsvector (newest * total / matches rows), or let the GIN index find every match and
    # keep the newest (`_walk_cheaper`). PostgreSQL underrates the first's cost and walks
    # 31k rows (17 ms) for two words in 6.5k rows at 100k; "seq + 0" hides the index from it.
    walk = _walk_cheaper(plan, _common_matches(statistics))
    older_order = "seq" if walk else "seq + 0"
    recent = ""
    recent_args: tuple[object, ...] = ()
    if window:
        # Materialized, so the older records' part can ask how many it found; that part is
        # gated on it (a one-time filter: never run when the recent records held enough).
        recent = (
            f"WITH recent AS MATERIALIZED (SELECT id, seq, {score} AS score FROM "
            f"{SEARCH_ROWS} WHERE {common} AND seq > %s ORDER BY seq + 0 DESC LIMIT %s) "
        )
        low = plan.total_rows - window
        recent_args = (*score_args, *common_args, low, plan.newest)
        newest_rows = (
            "SELECT * FROM recent UNION ALL "
            f"(SELECT id, seq, {score} AS score FROM {SEARCH_ROWS} WHERE {common} "
            f"AND seq <= %s AND (SELECT COUNT(*) FROM recent) < %s "
            f"ORDER BY {older_order} DESC LIMIT %s)"
        )
        newest_args: tuple[object, ...] = (
            *score_args,
            *common_args,
            low,
            plan.newest,
            plan.newest,
        )
    else:
        newest_rows = (
            f"SELECT id, seq, {score} AS score FROM {SEARCH_ROWS} WHERE {common} "
            f"ORDER BY {older_order} DESC LIMIT %s"
        )
        newest_args = (*score_args, *common_args, plan.newest)
    chosen = f"(SELECT * FROM ({newest_rows}) newest ORDER BY seq DESC LIMIT %s)"
    chosen_args = (*newest_args, plan.newest)
    if plan.rare:
        chosen += (
            f" UNION (SELECT id, seq, {score} AS score FROM {SEARCH_ROWS} WHERE {scoped} "
            f"AND tsv @@ ({_ts_any(plan.rare)}))"
        )
        chosen_args += (*score_args, *scope_args, *plan.rare)
    sql = f"{recent}SELECT id, score FROM ({chosen}) chosen ORDER BY score DESC, seq LIMIT %s"
    return sql, (*recent_args, *chosen_args, int(limit)), bool(window)
