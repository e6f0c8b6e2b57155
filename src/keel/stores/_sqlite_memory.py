"""Memory records in the embedded SQLite database: FTS5 keyword search + exact vector search.

The stock ``sqlite3`` module here cannot load extensions (no sqlite-vec), so vectors live in a
``memory_vectors`` table as float32 BLOBs (the source of truth) and each scope's vectors are
mirrored in an in-process numpy matrix, loaded on first search and topped up incrementally
from an AUTOINCREMENT rowid watermark (a re-embedded vector gets a new rowid, so it is picked
up too). Up to 20k vectors per scope, search is an exact cosine matmul. Above that, reading
every float32 row is what costs (150 MB per query at 100k x 384, memory-bound: 20-40 ms on a
2-core machine), so a sign-bit copy of each vector (48 bytes at 384 dims) shortlists the
nearest 4% (2% past 500k) by Hamming distance and only those rows are scored exactly. On
LoCoMo turns embedded by MiniLM, a 4% shortlist keeps 99.5% of the exact top 10. There is no
graph index to build, persist or repair: an HNSW build of 100k vectors takes minutes on 2 cores.
Candidates are always re-read through SQL with the scope and the filters applied, so a stale
cache entry (a deleted record) can never leak out.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from keel.memory._records import MemoryFilter, MemoryRecord, Scope, ShownSession
from keel.memory._rows import RECORD_COLUMNS, filter_sql, is_selective
from keel.memory._similarity import row_dots
from keel.memory._store import OutboxEntry, ScoredId
from keel.stores._dialect import SQLITE
from keel.stores._keywords import SCOPE_ROWS, TermFrequencies
from keel.stores._migrations import Migration, MigrationSet
from keel.stores._sql_memory import (
    MemorySchema,
    SQLMemoryStore,
    count_records,
    ids_of,
    require_database,
    rows_of,
    spans_by_session,
)
from keel.stores._sql_memory_erasure import DELETIONS_MIGRATION
from keel.stores._sql_plan import Plan, Statement
from keel.stores._sqlite import SQLiteDatabase
from keel.stores._sqlite_record_cache import CHANGES_MIGRATION, TrustedRecords, TurnKey

__all__ = ["MEMORY_MIGRATIONS", "SQLiteMemoryStore"]

FloatArray = npt.NDArray[np.float32]
_T = TypeVar("_T")
_COLUMNS = ", ".join(RECORD_COLUMNS)
_SESSION = RECORD_COLUMNS.index("session_id")
_TURN = RECORD_COLUMNS.index("turn")

MEMORY_MIGRATIONS = MigrationSet(
    "memory",
    (
        Migration(
            "memory records, full-text index, vectors and the embedding outbox",
            f"""
            CREATE TABLE memory_records (
                rowid INTEGER PRIMARY KEY,
                id TEXT NOT NULL UNIQUE,
                {MemorySchema.record_columns},
                created_at REAL NOT NULL,
                event_time REAL,
                subject TEXT,
                attribute TEXT,
                valid_from REAL,
                valid_to REAL,
                content_hash TEXT NOT NULL,
                embedding_model TEXT,
                metadata TEXT NOT NULL DEFAULT '{{}}',
                UNIQUE (tenant_id, user_id, content_hash)
            );
            {MemorySchema.record_indexes}
            CREATE VIRTUAL TABLE memory_fts USING fts5(
                text, content='memory_records', content_rowid='rowid',
                tokenize='porter unicode61'
            );
            CREATE TRIGGER memory_records_ai AFTER INSERT ON memory_records BEGIN
                INSERT INTO memory_fts(rowid, text) VALUES (new.rowid, new.text);
            END;
            CREATE TRIGGER memory_records_ad AFTER DELETE ON memory_records BEGIN
                INSERT INTO memory_fts(memory_fts, rowid, text)
                VALUES ('delete', old.rowid, old.text);
            END;
            CREATE TRIGGER memory_records_au AFTER UPDATE OF text ON memory_records BEGIN
                INSERT INTO memory_fts(memory_fts, rowid, text)
                VALUES ('delete', old.rowid, old.text);
                INSERT INTO memory_fts(rowid, text) VALUES (new.rowid, new.text);
            END;
            CREATE TABLE memory_vectors (
                rowid INTEGER PRIMARY KEY AUTOINCREMENT,
                record_id TEXT NOT NULL UNIQUE
                    REFERENCES memory_records(id) ON DELETE CASCADE,
                tenant_id TEXT NOT NULL,
                user_id TEXT NOT NULL,
                model TEXT NOT NULL,
                vector BLOB NOT NULL
            );
            CREATE INDEX memory_vectors_scope ON memory_vectors (tenant_id, user_id, model, rowid);
            CREATE TABLE memory_outbox (
                id INTEGER PRIMARY KEY AUTOINCREMENT,
                record_id TEXT NOT NULL REFERENCES memory_records(id) ON DELETE CASCADE,
                attempts INTEGER NOT NULL DEFAULT 0,
                last_error TEXT,
                created_at REAL NOT NULL
            );
            CREATE INDEX memory_outbox_record ON memory_outbox (record_id);
            """,
        ),
        Migration(
            "the full-text index carries each row's scope, so keyword search stays in it",
            # The token is a single word made of the scope's hex digits; the trailing 0 keeps
            # the porter stemmer from touching it. bm25() gives this column weight 0.
            """
            DROP TRIGGER memory_records_ai;
            DROP TRIGGER memory_records_ad;
            DROP TRIGGER memory_records_au;
            DROP TABLE memory_fts;
            ALTER TABLE memory_records ADD COLUMN scope_token TEXT GENERATED ALWAYS AS
                ('s' || hex(tenant_id || char(31) || user_id) || '0') VIRTUAL;
            CREATE VIRTUAL TABLE memory_fts USING fts5(
                text, scope_token, content='memory_records', content_rowid='rowid',
                tokenize='porter unicode61'
            );
            CREATE TRIGGER memory_records_ai AFTER INSERT ON memory_records BEGIN
                INSERT INTO memory_fts(rowid, text, scope_token)
                VALUES (new.rowid, new.text, new.scope_token);
            END;
            CREATE TRIGGER memory_records_ad AFTER DELETE ON memory_records BEGIN
                INSERT INTO memory_fts(memory_fts, rowid, text, scope_token)
                VALUES ('delete', old.rowid, old.text, old.scope_token);
            END;
            CREATE TRIGGER memory_records_au AFTER UPDATE OF text ON memory_records BEGIN
                INSERT INTO memory_fts(memory_fts, rowid, text, scope_token)
                VALUES ('delete', old.rowid, old.text, old.scope_token);
                INSERT INTO memory_fts(rowid, text, scope_token)
                VALUES (new.rowid, new.text, new.scope_token);
            END;
            INSERT INTO memory_fts(memory_fts) VALUES ('rebuild');
            """,
        ),
        MemorySchema.keyed_records("REAL"),
        MemorySchema.records_by_kind,
        DELETIONS_MIGRATION,
        CHANGES_MIGRATION,
    ),
)


# Scopes with more vectors than this are searched through the sign-bit shortlist.
_EXACT_VECTORS = 20_000
# Scopes up to this many vectors are searched on the event loop's thread (see searches_inline).
_INLINE_SEARCH_VECTORS = 10_000
# The shortlist's share of a scope's vectors, and its floor per requested result.
_SHORTLIST_SHARE = 25  # 1/25 = 4%
_SHORTLIST_PER_RESULT = 20
# Past 10k rows (250k vectors) the shortlist grows at half that share. Rescoring gathers rows
# scattered over a matrix far larger than the CPU's caches, so each costs a wait on memory: at
# 1M vectors of 256 dims a 4% shortlist (40k rows) took 16 ms to rescore against 10 ms for
# the Hamming pass over all 1M codes. 2% keeps 98.8% of the exact top 10 there (MiniLM
# static embeddings of 1M synthetic notes, 200 queries) against 99.55% for 4%.
_SHORTLIST_FULL_SHARE_ROWS = 10_000


def _shortlist_size(size: int, want: int) -> int:
    """How many of ``size`` vectors the sign bits shortlist for ``want`` results."""
    share = min(
        size // _SHORTLIST_SHARE, max(_SHORTLIST_FULL_SHARE_ROWS, size // (2 * _SHORTLIST_SHARE))
    )
    return min(size, max(want * _SHORTLIST_PER_RESULT, share))


def _sign_bits(vectors: FloatArray) -> npt.NDArray[np.uint64]:
    """Each row's signs packed into 64-bit words (zero-padded to a whole word)."""
    packed = np.packbits(vectors > 0, axis=1)
    width = -(-packed.shape[1] // 8) * 8
    if width != packed.shape[1]:
        packed = np.pad(packed, ((0, 0), (0, width - packed.shape[1])))
    bits: npt.NDArray[np.uint64] = np.ascontiguousarray(packed).view(np.uint64)
    return bits


# A record of no turn: never at or past a prompt's first shown turn.
_NO_TURN = -(2**62)


@dataclass
class _SessionPlaces:
    """Where one session's records sit in a `_ScopeIndex`: each one's position and turn (in
    arrays grown by doubling, the first ``count`` entries filled), and the positions of each
    key (its running summary's, say)."""

    positions: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(16, np.int64))
    turns: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(16, np.int64))
    count: int = 0
    keys: dict[str, list[int]] = field(default_factory=dict)

    def add(self, position: int, turn: int | None, key: str | None) -> None:
        if self.count == self.positions.size:
            self.positions = np.concatenate([self.positions, np.zeros_like(self.positions)])
            self.turns = np.concatenate([self.turns, np.zeros_like(self.turns)])
        # The entry is filled before it is counted: a reader sees only filled ones.
        self.positions[self.count] = position
        self.turns[self.count] = _NO_TURN if turn is None else turn
        if key is not None:
            self.keys.setdefault(key, []).append(position)
        self.count += 1

    def at_or_after(self, first_turn: int, size: int) -> npt.NDArray[np.int64]:
        """The positions below ``size`` of the session's records of ``first_turn`` or later."""
        count = self.count
        positions, turns = self.positions[:count], self.turns[:count]
        return positions[(turns >= first_turn) & (positions < size)]


@dataclass
class _ScopeIndex:
    """One scope's vectors for one model, mirrored from ``memory_vectors``, with where each
    vector's record sits (its session, turn and key: fixed for the record's life), so that
    what a prompt shows of its own session (``MemoryFilter.shown``) is left out before the
    nearest are picked, not read back and dropped one by one (in a session longer than the
    search's candidates, its own window is what lies nearest to each new question)."""

    dimension: int = 0
    matrix: FloatArray = field(default_factory=lambda: np.zeros((0, 0), dtype=np.float32))
    # Sign bits word by word, shape (words, capacity): a Hamming distance is then a few
    # whole-array operations instead of a slow reduction along a 6-wide axis.
    bits: npt.NDArray[np.uint64] = field(default_factory=lambda: np.zeros((0, 0), dtype=np.uint64))
    size: int = 0
    ids: list[str] = field(default_factory=list)
    # Each position's record's rowid in ``memory_records`` when the vector was mirrored (-1:
    # the record was gone): the nearest ids' check reads its rows by rowid (see
    # ``SQLiteMemoryStore._alive_first``).
    rowids: list[int] = field(default_factory=list)
    positions: dict[str, int] = field(default_factory=dict)
    watermark: int = 0
    sessions: dict[str, _SessionPlaces] = field(default_factory=dict)

    def add(
        self,
        record_id: str,
        vector: FloatArray,
        place: tuple[str | None, int | None, str | None] = (None, None, None),
        rowid: int | None = None,
    ) -> None:
        """Mirror ``record_id``'s vector; ``place``: its record's session, turn and key;
        ``rowid``: its record's rowid (None: the record is gone)."""
        position = self.positions.get(record_id)
        if position is None:
            session_id, turn, key = place
            if session_id is not None:
                self.sessions.setdefault(session_id, _SessionPlaces()).add(self.size, turn, key)
            if self.dimension == 0:
                self.dimension = int(vector.shape[0])
                self.matrix = np.zeros((1024, self.dimension), dtype=np.float32)
                self.bits = np.zeros((_sign_bits(self.matrix[:1]).shape[1], 1024), np.uint64)
            if self.size == self.matrix.shape[0]:
                self.matrix = np.concatenate([self.matrix, np.zeros_like(self.matrix)])
                self.bits = np.concatenate([self.bits, np.zeros_like(self.bits)], axis=1)
            position = self.size
            self.positions[record_id] = position
            self.ids.append(record_id)
            self.rowids.append(-1)
            self.size += 1
        # A record deleted and stored again under its id has another rowid: the latest wins.
        self.rowids[position] = -1 if rowid is None else rowid
        self.matrix[position] = vector
        self.bits[:, position] = _sign_bits(vector.reshape(1, -1))[0]

    def hidden(self, shown: ShownSession, size: int) -> npt.NDArray[np.bool_] | None:
        """Which of the first ``size`` positions hold records ``shown`` leaves out (as
        ``filter_sql`` does: of its session, at or past its first turn, or its summary);
        None when none does."""
        places = self.sessions.get(shown.session_id)
        if places is None or (shown.first_turn is None and shown.summary_key is None):
            return None
        hidden = np.zeros(size, dtype=bool)
        if shown.first_turn is not None:
            hidden[places.at_or_after(shown.first_turn, size)] = True
        if shown.summary_key is not None:
            for position in places.keys.get(shown.summary_key, ()):
                if position < size:
                    hidden[position] = True
        return hidden

    def nearest(
        self, query: FloatArray, want: int, shown: ShownSession | None = None
    ) -> tuple[npt.NDArray[np.int64], FloatArray]:
        """Positions of the ``want`` most similar vectors, best first, and their cosines;
        none of the records ``shown`` leaves out (fewer than ``want``: there are no more)."""
        # add() may replace the arrays meanwhile (to grow them): use one consistent set.
        # The size first: the arrays read after it were grown before it was.
        size = self.size
        matrix, bits = self.matrix, self.bits
        hidden = None if shown is None else self.hidden(shown, size)
        if size <= _EXACT_VECTORS:
            if hidden is None:
                rows = np.arange(size)
                scores = row_dots(matrix[:size], query)
            else:
                # Only the rows a search may return are scored: late in a long session most
                # of the index is its own window.
                rows = np.flatnonzero(~hidden)
                scores = _dots_by_runs(matrix, rows, query)
        else:
            distance = np.zeros(size, dtype=np.uint16)
            for word, query_word in zip(
                bits[:, :size], _sign_bits(query.reshape(1, -1))[0], strict=True
            ):
                distance += np.bitwise_count(word ^ query_word)
            if hidden is not None:
                distance[hidden] = np.iinfo(np.uint16).max
            rows = _smallest_positions(distance, _shortlist_size(size, want))
            if hidden is not None:
                rows = rows[~hidden[rows]]
            scores = _rescored(matrix, rows, query)
        want = min(want, rows.size)
        top = np.argpartition(-scores, want - 1)[:want] if want < rows.size else np.arange(want)
        top = top[np.argsort(-scores[top])]
        return rows[top], scores[top]


# Rows gathered and scored at a time: a few MB at once instead of the whole shortlist.
_RESCORE_ROWS = 8192

# Runs of consecutive rows `_dots_by_runs` scores one by one; more (rows scattered between
# sessions) and it scores the whole span at once.
_SCORED_RUNS = 16


def _dots_by_runs(matrix: FloatArray, rows: npt.NDArray[np.int64], query: FloatArray) -> FloatArray:
    """``row_dots(matrix, query)[rows]`` for ascending ``rows``, scoring only those rows: each
    run of consecutive rows is one product over a view of the matrix (no copy). Bit for bit
    the same scores: each row's dot product is summed on its own, in the same order, however
    many rows the product has (tested against the whole product)."""
    if rows.size == 0:
        return np.zeros(0, dtype=np.float32)
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    if breaks.size >= _SCORED_RUNS:
        return row_dots(matrix[: int(rows[-1]) + 1], query)[rows]
    starts = [0, *breaks.tolist()]
    ends = [*breaks.tolist(), int(rows.size)]
    firsts = rows[starts].tolist()
    return np.concatenate(
        [
            row_dots(matrix[first : first + end - start], query)
            for first, start, end in zip(firsts, starts, ends, strict=True)
        ]
    )


def _rescored(matrix: FloatArray, rows: npt.NDArray[np.int64], query: FloatArray) -> FloatArray:
    """The exact cosines of ``matrix[rows]`` against ``query``, gathered chunk by chunk."""
    scores = np.empty(rows.size, dtype=np.float32)
    for start in range(0, rows.size, _RESCORE_ROWS):
        chunk = rows[start : start + _RESCORE_ROWS]
        scores[start : start + chunk.size] = row_dots(matrix[chunk], query)
    return scores


def _smallest_positions(distance: npt.NDArray[np.uint16], count: int) -> npt.NDArray[np.int64]:
    """The positions of the ``count`` smallest distances, ascending (ties: lowest first).

    Distances are small integers, so instead of partitioning every one of them (10 ms at 1M)
    the cut-off distance is estimated from a 1/16 sample and corrected by counting, a pass of
    a fraction of a millisecond each. Ascending positions read the matrix front to back, which
    the CPU prefetches.
    """
    size = distance.size
    if count >= size:
        return np.arange(size)
    if count <= 0:
        return np.zeros(0, dtype=np.int64)
    sample = distance[::16]
    rank = min(sample.size - 1, count // 16)
    cut = int(np.partition(sample, rank)[rank])
    below = int(np.count_nonzero(distance < cut))
    while below >= count:  # too many strictly closer: the cut is lower
        cut -= 1
        below = int(np.count_nonzero(distance < cut))
    within = int(np.count_nonzero(distance <= cut))
    while within < count:  # too few at or under it: the cut is higher
        cut += 1
        below, within = within, int(np.count_nonzero(distance <= cut))
    # Now below < count <= within: everything under the cut, and the first of those at it.
    chosen = distance < cut
    chosen[np.flatnonzero(distance == cut)[: count - below]] = True
    return np.flatnonzero(chosen)


# Keyword search ranks at most about this many rows, whatever the table's size.
_SCORED_DOCUMENTS = 1500
# A query left with one word in more than half of the scope's rows (every word it has is that
# common, see ``informative_terms``) ranks only that word's newest rows, this many. BM25 tells
# such rows apart by length alone (the word's IDF is negative, FTS5 floors it at 1e-6), and
# ranking them all made a late turn of a long session (``keel bench turns``: every record
# holds "question") rank every record it had written. 600 is above the most any LoCoMo
# question ranks (550 rows of a 663-record conversation), so its recall is unchanged.
_COMMON_ONLY_ROWS = 600
# A term in more rows than this is dropped as common even when it is in fewer than 1/20 of
# them (tables over 400k rows). FTS5's bm25() walks every ranked term's whole doclist to count
# its rows before it scores one: at 1M rows the first-time keyword query p95 was 33 ms with
# 1/20 (50k rows a term) against 18 ms with this.
_MOST_COMMON_ROWS = 20_000


@dataclass(frozen=True)
class _KeywordQuery:
    """An FTS5 MATCH expression and a rowid restriction that bounds the rows it ranks."""

    match: str
    restriction: str = ""
    restriction_args: tuple[object, ...] = ()
    # Lower is better. FTS5's bm25() first counts each phrase's rows by walking its whole
    # doclist: 50 ms for one word in 84k of 1M rows, however few rows are then ranked. A
    # broad plan's one word is in more than 1/20 of the rows, so its newest matches are
    # ordered as BM25 orders the rows of one word at the same term frequency: shortest first
    # (characters standing in for tokens), then newest.
    score: str = "bm25(memory_fts, 1.0, 0.0)"


def _scope_token(scope: Scope) -> str:
    """The word the ``scope_token`` generated column holds for this scope's rows."""
    return "s" + f"{scope.tenant_id}\x1f{scope.user_id}".encode().hex() + "0"


def _match(terms: Sequence[str], scope: Scope | None) -> str:
    """Any of ``terms`` in the text; in ``scope``'s rows only when a scope is given."""
    phrases = " OR ".join(f'"{term}"' for term in terms)
    if scope is None:
        return f"text : ({phrases})"
    return f'text : ({phrases}) AND scope_token : "{_scope_token(scope)}"'


def _plan_keyword_query(
    scope: Scope, terms: list[str], frequencies: TermFrequencies, listed: int
) -> Plan[_KeywordQuery]:
    """The bounded query for ``terms`` in ``scope``, listing ``listed`` rows (see
    `keel.stores._keywords`)."""
    # The table's size, and how many transactions ever deleted from it (any process's).
    sized = (
        yield Statement(
            "SELECT (SELECT MAX(rowid) FROM memory_records), "
            "(SELECT deletions FROM memory_deletions)"
        )
    ).rows[0]
    total = int(sized[0] or 0)
    frequencies.saw_deletions(int(sized[1] or 0))
    scope_key = (scope.tenant_id, scope.user_id)
    # The scope token narrows a match to the scope's rows. For a scope that is nearly the
    # whole table (one user on a laptop) it is pure overhead: every matching row would also
    # be joined with the token's doclist. Rows are checked against the scope in SQL anyway.
    scope_rows = yield from frequencies.get(
        scope_key, SCOPE_ROWS, total, lambda _: count_records(scope)
    )
    small = total <= _SCORED_DOCUMENTS
    narrowing = scope if small or scope_rows < 0.9 * total else None

    def count(term: str, limit: int) -> Plan[int]:
        counted = yield Statement(
            "SELECT COUNT(*) FROM (SELECT rowid FROM memory_fts WHERE memory_fts MATCH ? LIMIT ?)",
            (_match([term], narrowing), limit),
        )
        return int(counted.rows[0][0])

    plan = yield from frequencies.plan(
        scope_key,
        terms,
        total_rows=total,
        scope_rows=scope_rows,
        listed=listed,
        budget=_SCORED_DOCUMENTS,
        count=count,
        most_common_rows=_MOST_COMMON_ROWS,
    )
    match = _match(plan.terms, scope if small else narrowing)
    if not plan.newest:
        if len(plan.terms) == 1:
            counted = frequencies.known(scope_key, plan.terms[0]) or 0
            common_only = yield from _newest_of_common_only(
                match, counted > max(scope_rows / 2, listed)
            )
            if common_only is not None:
                return common_only
        return _KeywordQuery(match)
    if small:
        return _KeywordQuery(match)
    floors = (
        yield Statement(
            "SELECT rowid FROM memory_fts WHERE memory_fts MATCH ? ORDER BY rowid DESC "
            "LIMIT 1 OFFSET ?",
            (_match(plan.common, narrowing), plan.newest),
        )
    ).rows
    if not floors:
        return _KeywordQuery(match)
    floor = floors[0]
    if not plan.rare:
        if plan.broad:
            return _KeywordQuery(
                match,
                " AND rowid >= ?",
                (int(floor[0]),),
                # Less than one character, less for a newer row: the newest of equals first.
                score="length(memory_fts.text) + 0.5 / memory_fts.rowid",
            )
        return _KeywordQuery(match, " AND rowid >= ?", (int(floor[0]),))
    return _KeywordQuery(
        match,
        " AND (rowid >= ? OR rowid IN (SELECT rowid FROM memory_fts WHERE memory_fts MATCH ?))",
        (int(floor[0]), _match(plan.rare, narrowing)),
    )


def _newest_of_common_only(match: str, common_only: bool) -> Plan[_KeywordQuery | None]:
    """The query ranking only the newest `_COMMON_ONLY_ROWS` rows of ``match`` (one word) when
    it is ``common_only`` (in more than half of the scope's rows, see ``informative_terms``)
    and has more matches than that; None otherwise (every match is ranked)."""
    if not common_only:
        return None
    oldest = (
        yield Statement(
            "SELECT rowid FROM memory_fts WHERE memory_fts MATCH ? ORDER BY rowid DESC "
            "LIMIT 1 OFFSET ?",
            (match, _COMMON_ONLY_ROWS - 1),
        )
    ).rows
    if not oldest:
        return None
    return _KeywordQuery(match, " AND rowid >= ?", (int(oldest[0][0]),))


class SQLiteMemoryStore(SQLMemoryStore):
    """Memory in one SQLite file (WAL), shared with keel's other embedded stores: FTS5
    keyword search, and exact vector search over an in-process copy of each scope's vectors.

    Args:
        db: the open [`SQLiteDatabase`][keel.stores.SQLiteDatabase] the records live in (left
            open by `close`).
    """

    inserted_order = "rowid"
    migrations = MEMORY_MIGRATIONS
    # Keyword and vector queries are both CPU work in this process: run one after the other.
    concurrent_searches = False

    def __init__(self, db: SQLiteDatabase) -> None:
        self._indexes: dict[tuple[str, str, str], _ScopeIndex] = {}
        self._index_lock = threading.Lock()
        # Records kept across reads, in step with every writer (see _sqlite_record_cache).
        self.trusted = TrustedRecords()
        self._sqlite = require_database(db, SQLiteDatabase, "SQLiteMemoryStore")
        super().__init__(self._sqlite)

    # --- reads served from the records kept -------------------------------------------------

    def fetch(
        self, scope: Scope, record_ids: Sequence[str], filters: MemoryFilter
    ) -> list[MemoryRecord]:
        if self._sqlite.in_transaction():
            return super().fetch(scope, record_ids, filters)
        return self.db.run(lambda: self._fetch(scope, record_ids, filters), write=False)

    def _fetch(
        self, scope: Scope, record_ids: Sequence[str], filters: MemoryFilter
    ) -> Plan[list[MemoryRecord]]:
        found = yield from self._fetch_by_id(scope, record_ids, filters)
        # In the order the statements give them (the expansion reads its seeds' names in
        # it): one statement a batch, each found through the id index, so by id (BINARY
        # order: a str's, code point by code point). Tested against the statements.
        ordered: list[MemoryRecord] = []
        for batch in SQLITE.batches(list(dict.fromkeys(record_ids))):
            ordered.extend(found[i] for i in sorted(batch) if i in found)
        return ordered

    def fetch_by_id(
        self, scope: Scope, record_ids: Sequence[str], filters: MemoryFilter
    ) -> dict[str, MemoryRecord]:
        if self._sqlite.in_transaction():  # what it reads may roll back, or be old
            return super().fetch_by_id(scope, record_ids, filters)
        return self.db.run(lambda: self._fetch_by_id(scope, record_ids, filters), write=False)

    def _fetch_by_id(
        self, scope: Scope, record_ids: Sequence[str], filters: MemoryFilter
    ) -> Plan[dict[str, MemoryRecord]]:
        trusted = self.trusted
        position = yield from trusted.catch_up()
        found, missing = trusted.kept(scope, record_ids, filters)
        if missing:
            read_at = self.records.forgets
            rows: list[tuple[object, ...]] = []
            for statement, params in self._scoped(_COLUMNS, scope, filters, missing):
                rows.extend(tuple(row) for row in (yield Statement(statement, params)).rows)
            for record in trusted.keep(
                position, rows, lambda row: self.records.record(row, read_at)
            ):
                found[record.id] = record
        return found

    def turns_around(
        self, scope: Scope, spans: Sequence[tuple[str, int, int]]
    ) -> list[MemoryRecord]:
        sessions = spans_by_session(spans)
        if self._sqlite.in_transaction() or any(not isinstance(t, list) for _, t in sessions):
            return super().turns_around(scope, spans)  # a long range is read as one
        keys = [
            (scope.tenant_id, scope.user_id, session_id, turn)
            for session_id, turns in sessions
            for turn in turns
        ]
        if not keys:
            return []
        return self.db.run(lambda: self._turns_around(scope, keys), write=False)

    def _turns_around(self, scope: Scope, keys: list[TurnKey]) -> Plan[list[MemoryRecord]]:
        trusted = self.trusted
        position = yield from trusted.catch_up()
        found, missing = trusted.kept_turns(keys)
        if missing:
            by_session: dict[str, list[int]] = {}
            for _, _, session_id, turn in missing:
                by_session.setdefault(session_id, []).append(turn)
            read: dict[TurnKey, list[MemoryRecord]] = {key: [] for key in missing}
            read_at = self.records.forgets
            statement = Statement(*self._turns_sql(scope, list(by_session.items())))
            for row in (yield statement).rows:
                record = self.records.record(row, read_at)
                key = (scope.tenant_id, scope.user_id, row[_SESSION], row[_TURN])
                read[key].append(record)
            whole = {key: tuple(records) for key, records in read.items()}
            trusted.keep_turns(position, whole)
            found.update(whole)
        return [record for key in keys for record in found[key]]

    def keyword_search(
        self, scope: Scope, terms: Sequence[str], filters: MemoryFilter, limit: int
    ) -> list[ScoredId]:
        # Terms are [a-z0-9] words (keyword_terms); quoting them makes each a plain phrase so
        # nothing can act as an FTS5 operator or column filter.
        safe = [term.replace('"', "") for term in terms if term.strip('"')]
        if not safe or limit <= 0:
            return []
        return self.db.run(
            lambda: self._keyword_search(scope, safe, filters, int(limit)), write=False
        )

    def _keyword_search(
        self, scope: Scope, safe: list[str], filters: MemoryFilter, limit: int
    ) -> Plan[list[ScoredId]]:
        plan = yield from _plan_keyword_query(scope, safe, self._term_frequencies, limit)
        where, params = filter_sql(filters, "?", prefix="r.")
        # The scope is in the MATCH expression (fast) and checked on the rows again.
        scoped = "r.tenant_id = ? AND r.user_id = ?" + (f" AND {where}" if where else "")
        args = (scope.tenant_id, scope.user_id, *params)
        # Fast path: the scope's best matches, ranked by the index; the filters (types,
        # superseded facts, time) apply after. When they removed too many, rank again with
        # the filters inside the query.
        window = max(limit * 4, 200)
        fast = (
            f"SELECT r.id, f.score FROM (SELECT rowid, {plan.score} AS score "
            f"FROM memory_fts WHERE memory_fts MATCH ?{plan.restriction} "
            "ORDER BY score LIMIT ?) f JOIN memory_records r ON r.rowid = f.rowid "
            f"WHERE {scoped} ORDER BY f.score LIMIT ?"
        )
        rows = (
            yield Statement(fast, (plan.match, *plan.restriction_args, window, *args, limit))
        ).rows
        if len(rows) < limit:
            total = (
                yield Statement(
                    "SELECT COUNT(*) FROM (SELECT rowid FROM memory_fts WHERE memory_fts MATCH ? "
                    f"{plan.restriction} LIMIT ?)",
                    (plan.match, *plan.restriction_args, window + 1),
                )
            ).rows[0][0]
            if int(total) > window:
                full = (
                    f"SELECT r.id, {plan.score} AS score FROM memory_fts "
                    "JOIN memory_records r ON r.rowid = memory_fts.rowid "
                    f"WHERE memory_fts MATCH ?{plan.restriction} AND {scoped} "
                    "ORDER BY score LIMIT ?"
                )
                rows = (
                    yield Statement(full, (plan.match, *plan.restriction_args, *args, limit))
                ).rows
        # Scores are lower for better rows (FTS5's bm25() is negative): negated, higher is.
        return [ScoredId(str(row[0]), -float(row[1])) for row in rows]

    async def acall(self, call: Callable[[], _T]) -> _T:
        # The database's way: inline unless the call would wait for the write lock (a thread
        # switch each way costs more than a turn's memory write), as keel's other SQLite
        # stores' calls; a read never waits for it.
        return await self.db.acall(call)

    def searches_inline(self, scope: Scope, model: str | None) -> bool:
        # Inline once the scope's vectors are in this process (their first load reads them
        # all) and few: then a search is a few milliseconds whatever it finds (the keyword
        # query ranks a bounded number of rows), about what two thread switches cost a turn
        # on a busy machine.
        index = self._indexes.get((scope.tenant_id, scope.user_id, model or ""))
        return model is not None and index is not None and index.size <= _INLINE_SEARCH_VECTORS

    def _index(self, scope: Scope, model: str) -> _ScopeIndex:
        key = (scope.tenant_id, scope.user_id, model)
        with self._index_lock:
            index = self._indexes.setdefault(key, _ScopeIndex())
            # Each vector with where its record sits (a record's session, turn and key never
            # change; a vector whose record is gone mid-read is mirrored without them, as
            # before, and never returned: candidates are re-read through SQL).
            newer = Statement(
                "SELECT v.rowid, v.record_id, v.vector, r.session_id, r.turn, r.key, r.rowid "
                "FROM memory_vectors v LEFT JOIN memory_records r ON r.id = v.record_id "
                "WHERE v.tenant_id = ? AND v.user_id = ? AND v.model = ? AND v.rowid > ? "
                "ORDER BY v.rowid",
                (scope.tenant_id, scope.user_id, model, index.watermark),
            )
            for rowid, record_id, blob, session_id, turn, key, record_rowid in self.db.run(
                lambda: rows_of(newer), write=False
            ):
                index.add(
                    str(record_id),
                    np.frombuffer(blob, dtype=np.float32),
                    (session_id, turn, key),
                    None if record_rowid is None else int(record_rowid),
                )
                index.watermark = int(rowid)
            return index

    def vector_search(
        self, scope: Scope, vector: FloatArray, model: str, filters: MemoryFilter, limit: int
    ) -> list[ScoredId]:
        index = self._index(scope, model)
        if index.size == 0 or limit <= 0:
            return []
        query = np.asarray(vector, dtype=np.float32).reshape(-1)
        if query.shape[0] != index.dimension:
            return []
        if is_selective(filters):
            # A narrow filter (replay examples, one session) is resolved in SQL first so the
            # nearest rows are never all filtered away afterwards.
            allowed = self._scoped_ids(scope, filters)
            positions = np.array(
                [index.positions[i] for i in allowed if i in index.positions], dtype=np.int64
            )
            if positions.size == 0:
                return []
            scores = row_dots(index.matrix[positions], query)
            order = np.argsort(-scores)[:limit]
            return [ScoredId(index.ids[int(positions[o])], float(scores[o])) for o in order]
        want = limit * 2 + 20
        while True:
            positions, scores = index.nearest(query, want, filters.shown)
            kept = self._alive_first(scope, filters, index, (positions, scores), limit)
            # The filters left fewer than ``limit`` of the nearest (expired records left
            # out, say) and there are more rows: the next nearest are read too.
            if len(kept) >= limit or positions.size < want or want >= index.size:
                return [ScoredId(i, s) for i, s in kept]
            want *= 4

    def _alive_first(
        self,
        scope: Scope,
        filters: MemoryFilter,
        index: _ScopeIndex,
        nearest: tuple[npt.NDArray[np.int64], FloatArray],
        limit: int,
    ) -> list[tuple[str, float]]:
        """The first ``limit`` of the ``nearest`` positions of ``index`` (with their scores)
        whose records are in ``scope`` and pass ``filters``. Rows are checked ``limit`` at a
        time (then as many as were dropped, and a margin), not all at once: a filtered-out
        record is rare, so one read of ``limit`` ids usually settles it (and only the
        positions checked are looked up)."""
        positions, scores = nearest[0].tolist(), nearest[1].tolist()
        ids, rowids = index.ids, index.rowids
        kept: list[tuple[str, float]] = []
        start = 0
        while len(kept) < limit and start < len(positions):
            missing = limit - len(kept)
            end = start + (limit if start == 0 else missing + 20)
            chunk = [
                (ids[position], score, rowids[position])
                for position, score in zip(positions[start:end], scores[start:end], strict=True)
            ]
            start += len(chunk)
            alive = self._alive_ids(scope, filters, chunk)
            kept.extend((record_id, score) for record_id, score, _ in chunk if record_id in alive)
        return kept[:limit]

    def _alive_ids(
        self, scope: Scope, filters: MemoryFilter, chunk: Sequence[tuple[str, float, int]]
    ) -> set[str]:
        """The ids of ``chunk`` whose rows are in ``scope`` and pass ``filters``: read by
        rowid (one B-tree search a row, where an id costs two: its index's, then the
        table's; 70 us against 120 us for 100 rows), each row's id compared with the one
        expected at that rowid (a deleted record's rowid may be another's now). Those not
        found so are checked by id, as before: their record may have been stored again
        under another rowid since its vector was mirrored."""
        by_rowid = [rowid for _, _, rowid in chunk if rowid >= 0]
        alive: set[str] = set()
        if by_rowid:
            where, params = filter_sql(filters, "?")
            condition = f" AND {where}" if where else ""
            statements = []
            for batch in SQLITE.batches(by_rowid):
                rowids, rowid_params = SQLITE.one_of("rowid", batch)
                statements.append(
                    Statement(
                        "SELECT id FROM memory_records WHERE +tenant_id = ? AND +user_id = ? "
                        f"AND {rowids}{condition}",
                        (scope.tenant_id, scope.user_id, *rowid_params, *params),
                    )
                )
            alive.update(self.db.run(lambda: ids_of(statements), write=False))
        unsure = [record_id for record_id, _, _ in chunk if record_id not in alive]
        if unsure:
            alive.update(self._scoped_ids(scope, filters, unsure))
        return alive

    def vectors(self, scope: Scope, record_ids: Sequence[str], model: str) -> dict[str, FloatArray]:
        # A search asks for its candidates' vectors just after its vector search topped the
        # index up: it is topped up again (a read of the newer vectors) only when one of them
        # is not in it yet.
        index = self._indexes.get((scope.tenant_id, scope.user_id, model))
        if index is None or any(record_id not in index.positions for record_id in record_ids):
            index = self._index(scope, model)
        return {
            record_id: index.matrix[index.positions[record_id]]
            for record_id in record_ids
            if record_id in index.positions
        }

    def _write_vectors(
        self, entries: Sequence[OutboxEntry], vectors: Sequence[FloatArray], model: str
    ) -> Plan[None]:
        yield Statement(
            "INSERT OR REPLACE INTO memory_vectors (record_id, tenant_id, user_id, model, vector) "
            "SELECT id, tenant_id, user_id, ?, ? FROM memory_records WHERE id = ?",
            [
                (model, np.asarray(vector, dtype=np.float32).tobytes(), entry.record_id)
                for entry, vector in zip(entries, vectors, strict=True)
            ],
            many=True,
        )

    def _vector_table_names(self) -> Plan[list[str]]:
        yield from ()
        return ["memory_vectors"]

    def _after_erasure(self, tenant_id: str, user_id: str) -> Plan[None]:
        # FTS5 deletes leave the old terms in earlier index segments (marked deleted) until
        # they are merged: 'optimize' merges them all, so none of the user's words is left.
        yield Statement("INSERT INTO memory_fts(memory_fts) VALUES ('optimize')")

    def erase_user(self, tenant_id: str, user_id: str) -> dict[str, int]:
        counts = super().erase_user(tenant_id, user_id)
        self.trusted.forget(tenant_id, user_id)
        with self._index_lock:  # the in-process copies of the scope's vectors go too
            for key in [key for key in self._indexes if key[:2] == (tenant_id, user_id)]:
                del self._indexes[key]
        return counts

    def close(self) -> None:
        with self._index_lock:
            self._indexes.clear()
        self.trusted.forget()

    def __repr__(self) -> str:
        return f"SQLiteMemoryStore({self.db!r})"
