"""Memory records in PostgreSQL: tsvector full text ranked by BM25, and pgvector HNSW.

Scope and filters are applied in SQL, server-side, in every query. Vectors live in one table
per dimension (``memory_vectors_384`` ...) so a model change to another size needs no schema
edit; each has an HNSW index (cosine). pgvector indexes ``vector`` columns of up to 2,000
dimensions, so wider embeddings (3,072 for text-embedding-3-large) are indexed as ``halfvec``
(up to 4,000); wider still are searched exactly. Searches run with ``hnsw.iterative_scan`` so a
scope that is a small part of a shared index still gets its full ``limit`` of rows. psycopg is
imported lazily: keel works without the ``postgres`` extra until this store is built, and
building it applies its schema, as every store's is.
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import numpy as np
import numpy.typing as npt

from keel._bridge import fork
from keel.errors import ConfigError, StoreError
from keel.memory._records import (
    MemoryFilter,
    MemoryRecord,
    Scope,
    is_fact,
)
from keel.memory._rows import (
    RECORD_COLUMNS,
    filter_sql,
    record_to_row,
)
from keel.memory._store import InsertResult, OutboxEntry, ScoredId
from keel.stores._keywords import (
    AVERAGE_LENGTH_MILLI,
    TermFrequencies,
    common_term_cap,
)
from keel.stores._migrations import Migration, MigrationSet
from keel.stores._postgres import BinaryVector, PostgresDatabase
from keel.stores._postgres_keywords import KeywordStatistics, keyword_ranking, with_bitmaps
from keel.stores._postgres_search_rows import MEMORY_SEARCH_ROWS_MIGRATION, SEARCH_ROWS
from keel.stores._postgres_terms import MEMORY_TERMS_MIGRATION, ScopeTerms, scope_terms
from keel.stores._sql_memory import (
    MemorySchema,
    SQLMemoryStore,
    insert_row_sql,
    require_database,
    rows_of,
    stored_content,
)
from keel.stores._sql_memory_erasure import DELETIONS_MIGRATION
from keel.stores._sql_plan import Plan, Statement

__all__ = ["POSTGRES_MEMORY_MIGRATIONS", "PostgresMemoryStore"]

FloatArray = npt.NDArray[np.float32]
logger = logging.getLogger(__name__)

POSTGRES_MEMORY_MIGRATIONS = MigrationSet(
    "memory",
    (
        Migration(
            "memory records with full text, the embedding outbox",
            f"""
            CREATE EXTENSION IF NOT EXISTS vector;
            CREATE TABLE memory_records (
                seq BIGSERIAL UNIQUE,
                id TEXT PRIMARY KEY,
                {MemorySchema.record_columns},
                created_at DOUBLE PRECISION NOT NULL,
                event_time DOUBLE PRECISION,
                subject TEXT,
                attribute TEXT,
                valid_from DOUBLE PRECISION,
                valid_to DOUBLE PRECISION,
                content_hash TEXT NOT NULL,
                embedding_model TEXT,
                metadata JSONB NOT NULL DEFAULT '{{}}',
                tsv tsvector GENERATED ALWAYS AS (to_tsvector('english', text)) STORED,
                UNIQUE (tenant_id, user_id, content_hash)
            );
            {MemorySchema.record_indexes}
            CREATE INDEX memory_records_tsv ON memory_records USING GIN (tsv);
            CREATE TABLE memory_outbox (
                id BIGSERIAL PRIMARY KEY,
                record_id TEXT NOT NULL REFERENCES memory_records(id) ON DELETE CASCADE,
                attempts INTEGER NOT NULL DEFAULT 0,
                last_error TEXT,
                created_at DOUBLE PRECISION NOT NULL
            );
            CREATE INDEX memory_outbox_record ON memory_outbox (record_id);
            """,
        ),
        MemorySchema.keyed_records("DOUBLE PRECISION"),
        Migration(
            "a short GIN pending list: searches right after a burst of writes stay fast",
            # Fast-update GIN keeps new rows in an unsorted pending list that every keyword
            # search scans in full until VACUUM (or the list's limit) merges it; at the 4 MB
            # default, keyword search right after a bulk load took 2-3x its settled time.
            # 256 kB keeps the scan short and writes as fast (1,070-1,090 against
            # 1,090-1,150 records/s at 5,000; fastupdate off cost 5-8%).
            """
            ALTER INDEX memory_records_tsv SET (gin_pending_list_limit = 256);
            """,
        ),
        MemorySchema.records_by_kind,
        Migration(
            "records' pages half full: a record's embedding_model is set in place",
            # The outbox sets each record's embedding_model once its vector is written. On a
            # full page that UPDATE writes the new row version to another page and a new entry
            # into every index (the GIN of its words among them) until VACUUM removes the old
            # ones; with room on the page it is a HOT update, touching no index. At 20,000
            # records (hashing:384 vectors) the outbox's UPDATEs took 1,034 ms at fillfactor
            # 100 and under 200 ms at 50 (18,392 of 20,000 HOT). The price is the heap: at
            # 200,000 records, after VACUUM, it took 206 MB against 135 MB, while the indexes,
            # with no second entries to split their pages, took 89 MB against 127 MB (4,837
            # against 4,667 bytes a record in all, the HNSW graph included).
            """
            ALTER TABLE memory_records SET (fillfactor = 50);
            """,
        ),
        MEMORY_TERMS_MIGRATION,
        DELETIONS_MIGRATION,
        MEMORY_SEARCH_ROWS_MIGRATION,
    ),
)

# A new record and its outbox entry, written together or not at all (one statement).
_INSERT_WITH_OUTBOX = (
    "WITH inserted AS ({insert}), "
    "queued AS (INSERT INTO memory_outbox (record_id, created_at) SELECT id, ? FROM inserted) "
    "SELECT id FROM inserted"
)
# Plain records of a batch in one statement: each column one array parameter (a short text
# psycopg parses once, whatever the rows), unnested back into rows.
_ARRAY_TYPES = {
    "step": "int[]",
    "turn": "int[]",
    "created_at": "float8[]",
    "event_time": "float8[]",
    "valid_from": "float8[]",
    "valid_to": "float8[]",
    "expires_at": "float8[]",
}
_INSERT_ROWS = _INSERT_WITH_OUTBOX.format(
    insert=(
        f"INSERT INTO memory_records ({', '.join(RECORD_COLUMNS)}) SELECT "
        + ", ".join(
            f"{column}::jsonb" if column == "metadata" else column for column in RECORD_COLUMNS
        )
        + " FROM unnest("
        + ", ".join(f"?::{_ARRAY_TYPES.get(column, 'text[]')}" for column in RECORD_COLUMNS)
        + f") AS rows ({', '.join(RECORD_COLUMNS)}) "
        "ON CONFLICT (tenant_id, user_id, content_hash) DO NOTHING RETURNING id"
    )
)
# Plain records written by one INSERT in a batch: PostgreSQL takes at most 65,535
# parameters a statement, and a record has about 20.
_ROWS_PER_INSERT = 1000
# Vectors written by one INSERT (two parameters each, of PostgreSQL's 65,535 a statement).
_VECTORS_PER_INSERT = 1000
_VECTOR_TABLE = re.compile(r"^memory_vectors_(\d+)$")
# pgvector's HNSW limits: 2,000 dimensions for ``vector``, 4,000 for ``halfvec``.
_HNSW_VECTOR_MAX = 2000
_HNSW_HALFVEC_MAX = 4000


def _vector_literal(vector: FloatArray) -> str:
    return "[" + ",".join(f"{float(x):.7g}" for x in np.asarray(vector).reshape(-1)) + "]"


def _vector_from_binary(data: bytes) -> FloatArray:
    """A pgvector ``vector`` in its binary wire format: int16 dimension, int16 unused, then
    big-endian float4s (the text format costs 7x more to parse: 25 ms against 3.6 ms for 120
    vectors of 384 dimensions)."""
    dimension = int.from_bytes(data[:2], "big")
    return np.frombuffer(data, dtype=">f4", count=dimension, offset=4).astype(np.float32)


def _dimension(vectors: Sequence[FloatArray]) -> int:
    """The dimension of a batch of vectors (one model made them all)."""
    return int(np.asarray(vectors[0]).reshape(-1).shape[0])


def _hnsw_operand(dimension: int, halfvec: bool = False) -> tuple[str, str] | None:
    """The indexed expression and its cast for a query vector; None when HNSW cannot index it.
    ``halfvec`` indexes 16-bit floats even where ``vector`` could be indexed."""
    if dimension <= _HNSW_VECTOR_MAX and not halfvec:
        return "embedding", "vector"
    if dimension <= _HNSW_HALFVEC_MAX:
        return f"embedding::halfvec({dimension})", f"halfvec({dimension})"
    return None


# Keyword search ranks at most this many rows, the same budget as SQLite's bm25().
_SCORED_ROWS = 1500
# A term in more rows than this is dropped as common, however large the table (SQLite's
# bound too). It once bounded counting a term's rows, which read each match (1/20 of the
# table, the bound below this, grew with it); counts now come from memory_terms, and the
# bound keeps the plans (which terms are common) what they were.
_MOST_COMMON_ROWS = 20_000


class PostgresMemoryStore(SQLMemoryStore):
    """Memory in PostgreSQL with pgvector (safe across threads).

    Args:
        database: the [`PostgresDatabase`][] the records live in (left open
            by `close`).
        hnsw: build an HNSW index (cosine) when a vector table is created: approximate and
            fast at scale. False keeps exact scans. Either way the planner ranks a small scope
            exactly from its scope index when that is cheaper than walking the graph.
        ef_search: HNSW candidate list size per search (pgvector's ``hnsw.ef_search``,
            1..1000); higher is slower with better recall. Iterative scans extend it when a
            search asks for more rows or filters many out.
        halfvec: index (and search) the vectors as 16-bit ``halfvec``: the graph takes about
            half the bytes and memory; vectors are still stored as 32-bit floats. It names the
            index's expression, so every store on the database must agree: a store whose
            setting differs from the index it finds searches exactly, without the index.
    """

    inserted_order = "seq"
    migrations = POSTGRES_MEMORY_MIGRATIONS
    db: PostgresDatabase

    def __init__(
        self,
        db: PostgresDatabase,
        *,
        hnsw: bool = True,
        ef_search: int = 100,
        halfvec: bool = False,
    ) -> None:
        if not 1 <= ef_search <= 1000:
            raise ConfigError(f"ef_search must be within 1..1000 (pgvector's range): {ef_search}")
        self.hnsw = hnsw
        self.ef_search = int(ef_search)
        self.halfvec = halfvec
        self._vector_tables: set[int] = set()
        self._statistics = _GrowthStatistics(db)
        super().__init__(require_database(db, PostgresDatabase, "PostgresMemoryStore"))

    def setup(self) -> None:
        """Apply the schema and find the vector tables there: run when the store is built
        (later calls return at once)."""
        if self._ready:
            return
        self.db.migrate(self.migrations)
        tables = Statement(
            "SELECT tablename FROM pg_tables WHERE tablename LIKE 'memory_vectors_%%'"
        )
        for (name,) in self.db.run(lambda: rows_of(tables), write=False):
            match = _VECTOR_TABLE.match(str(name))
            if match:
                self._vector_tables.add(int(match.group(1)))
        self._ready = True

    def _ensure_vector_table(self, dimension: int) -> Plan[str]:
        table = f"memory_vectors_{int(dimension)}"
        if dimension not in self._vector_tables:
            yield Statement(f"SELECT pg_advisory_xact_lock(hashtext('{table}'))")
            yield Statement(
                f"CREATE TABLE IF NOT EXISTS {table} ("
                "record_id TEXT PRIMARY KEY REFERENCES memory_records(id) ON DELETE CASCADE, "
                "tenant_id TEXT NOT NULL, user_id TEXT NOT NULL, model TEXT NOT NULL, "
                f"embedding vector({int(dimension)}) NOT NULL)"
            )
            operand = _hnsw_operand(dimension, self.halfvec)
            if self.hnsw and operand is not None:
                yield _hnsw_index_statement(table, operand)
            yield Statement(
                f"CREATE INDEX IF NOT EXISTS {table}_scope ON {table} (tenant_id, user_id, model)"
            )
            # Not added to _vector_tables here: the caller does after its transaction commits.
            # Added before, a search on another thread saw the table in the set and queried it
            # while it was still uncommitted ("relation memory_vectors_64 does not exist").
        return table

    # --- writes -------------------------------------------------------------------------

    def insert(self, record: MemoryRecord) -> InsertResult:
        if record.key is None and not is_fact(record):
            result = self._insert_plain(record)
        else:
            result = super().insert(record)
        if result.created:
            self._statistics.wrote({"memory_records": 1, "memory_outbox": 1, SEARCH_ROWS: 1})
        return result

    def insert_many(self, records: Sequence[MemoryRecord]) -> list[InsertResult]:
        # One transaction for the batch, as `add_many` promises (all or none), and one commit
        # (a WAL flush) instead of one per record: a bulk load wrote 1,400 records/s one by one.
        if not records:
            return []
        if len(records) == 1:
            # `Memory.add`: one statement in autocommit, without BEGIN and COMMIT round trips.
            return [self.insert(records[0])]
        results = self.db.run(lambda: self._insert_batch(records))
        created = sum(1 for result in results if result.created)
        if created:
            self._statistics.wrote(
                {"memory_records": created, "memory_outbox": created, SEARCH_ROWS: created}
            )
        return results

    def _insert_batch(self, records: Sequence[MemoryRecord]) -> Plan[list[InsertResult]]:
        """``records`` in order: each run of plain ones (no key, no fact) in one statement
        with their outbox entries, a keyed record or a fact on its own (it may replace)."""
        results: list[InsertResult] = []
        start = 0
        while start < len(records):
            end = start
            while (
                end < len(records)
                and end - start < _ROWS_PER_INSERT
                and records[end].key is None
                and not is_fact(records[end])
            ):
                end += 1
            if end > start:
                results.extend((yield from self._insert_plain_rows(records[start:end])))
                start = end
            else:
                results.append((yield from self._insert(records[start])))
                start += 1
        return results

    def _insert_plain_rows(self, records: Sequence[MemoryRecord]) -> Plan[list[InsertResult]]:
        """Plain records and their outbox entries in one statement: a statement a record in
        one transaction spent 6.0 s of 5,000 records' 7.2 s in round trips (a loaded 2-core
        machine), one for 512 records wrote them in 1.3 s. A content its scope holds
        already, even from earlier in the same rows, is the record stored first."""
        columns = list(zip(*(record_to_row(record) for record in records), strict=True))
        arrays = tuple(list(values) for values in columns)
        created = {
            str(row[0]) for row in (yield Statement(_INSERT_ROWS, (*arrays, time.time()))).rows
        }
        results = []
        for record in records:
            if record.id in created:
                results.append(InsertResult(record, created=True))
            else:
                results.append(InsertResult((yield from stored_content(record)), created=False))
        return results

    def _lock(self, what: str, record: MemoryRecord, name: str) -> Plan[None]:
        """Take the transaction's advisory lock on one name of the record's scope (a key, a
        fact): writers of the same name take turns, others never wait."""
        yield Statement(
            "SELECT pg_advisory_xact_lock(hashtextextended(?, 0))",
            (f"{what}\x1f{record.tenant_id}\x1f{record.user_id}\x1f{name}",),
        )

    def _insert_plain(self, record: MemoryRecord) -> InsertResult:
        """A record that replaces nothing (no key, no fact to supersede): the row and its
        outbox entry in one statement, itself atomic, so one round trip instead of four."""
        return self.db.run(lambda: self._insert_with_outbox(record), write=False)

    def _insert_with_outbox(self, record: MemoryRecord) -> Plan[InsertResult]:
        insert = _INSERT_WITH_OUTBOX.format(insert=insert_row_sql(self.db.dialect))
        if not (yield Statement(insert, (*record_to_row(record), time.time()))).rows:
            return InsertResult((yield from stored_content(record)), created=False)
        return InsertResult(record, created=True)

    def build_hnsw_indexes(self) -> list[str]:
        """Build the HNSW index of every vector table that has none; the names built.

        For bulk loads: a store opened with ``hnsw=False`` writes vectors without walking a
        graph per row, and one build afterwards is several times faster than the inserts'
        (pgvector's build, with the server's ``maintenance_work_mem`` and parallel workers;
        ``m`` 16 and ``ef_construction`` 64, its defaults). Tables wider than HNSW can index
        are left to exact search. Idempotent; searches use a built index at once.
        """
        built = []
        tables = self.db.run(self._vector_table_names, write=False)
        for table in tables:
            match = _VECTOR_TABLE.match(table)
            operand = _hnsw_operand(int(match.group(1)), self.halfvec) if match else None
            if operand is None:
                continue
            exists = Statement("SELECT to_regclass(?)", (f"{table}_hnsw",))
            if self.db.run(partial(rows_of, exists), write=False)[0][0] is not None:
                continue
            self.db.run(partial(_run_one, _hnsw_index_statement(table, operand)), write=False)
            built.append(f"{table}_hnsw")
        return built

    # --- search -------------------------------------------------------------------------

    def keyword_search(
        self, scope: Scope, terms: Sequence[str], filters: MemoryFilter, limit: int
    ) -> list[ScoredId]:
        # Each term goes through plainto_tsquery (a parameter, never spliced into SQL), so
        # operators in the text are just words; the per-term queries are OR-ed together.
        safe = list(dict.fromkeys(t for t in terms if t.strip()))
        if not safe or limit <= 0:
            return []
        where, params = filter_sql(filters, "%s")
        scoped = "tenant_id = %s AND user_id = %s" + (f" AND {where}" if where else "")
        scope_args = (scope.tenant_id, scope.user_id, *params)
        statistics = self.db.run(
            lambda: self._keyword_statistics(scope, safe, int(limit)), write=False
        )
        ranking, windowed = keyword_ranking(statistics, scoped, scope_args, int(limit))
        if windowed:
            rows = self.db.run(lambda: with_bitmaps(ranking))
        else:
            rows = self.db.run(lambda: rows_of(ranking), write=False)
        return [ScoredId(str(r[0]), float(r[1])) for r in rows]

    def _keyword_statistics(
        self, scope: Scope, terms: list[str], listed: int
    ) -> Plan[KeywordStatistics]:
        """The bounded plan for ``terms`` in ``scope``, listing ``listed`` rows (see
        `keel.stores._keywords`)
        and what BM25 needs: each term's IDF and the scope's average record length."""
        # The table's size, and how many transactions ever deleted from it (any process's).
        sized = (
            yield Statement(
                "SELECT (SELECT COALESCE(MAX(seq), 0) FROM memory_records), "
                "(SELECT deletions FROM memory_deletions)"
            )
        ).rows[0]
        total = int(sized[0])
        self._term_frequencies.saw_deletions(int(sized[1] or 0))
        scope_key = (scope.tenant_id, scope.user_id)
        cap = common_term_cap(total, _MOST_COMMON_ROWS)
        # Every count exact and current, from memory_terms (one statement); only a word of
        # several lexemes is counted from the records, as before.
        known: ScopeTerms = yield from scope_terms(scope, terms)

        def count(term: str, limit: int) -> Plan[int]:
            rows = known.rows(term)
            if rows is not None:
                # Bounded as a count from the records was, so plans stay as they were.
                return min(rows, limit)
            counted = yield Statement(
                f"SELECT COUNT(*) FROM (SELECT 1 FROM {SEARCH_ROWS} WHERE tenant_id = ? "
                "AND user_id = ? AND tsv @@ plainto_tsquery('english', ?) LIMIT ?) s",
                (scope.tenant_id, scope.user_id, term, limit),
            )
            return int(counted.rows[0][0])

        def length_milli(_: str) -> Plan[int]:
            # The newest records' average, so it follows what the scope holds now.
            average = yield Statement(
                "SELECT AVG(length(tsv)) FROM (SELECT tsv FROM memory_records WHERE "
                "tenant_id = ? AND user_id = ? ORDER BY created_at DESC LIMIT 1000) s",
                scope_key,
            )
            return round(1000 * float(average.rows[0][0] or 0))

        scope_rows = known.scope_rows
        # Counts made for this search alone: the table's are exact, never stale.
        frequencies = TermFrequencies()
        plan = yield from frequencies.plan(
            scope_key,
            terms,
            total_rows=total,
            scope_rows=scope_rows,
            listed=listed,
            budget=_SCORED_ROWS,
            count=count,
            most_common_rows=_MOST_COMMON_ROWS,
        )
        matches: dict[str, int] = {}
        for term in plan.terms:
            matches[term] = yield from frequencies.get(
                scope_key, term, total, lambda t: count(t, cap + 1)
            )
        rows = max(scope_rows, *matches.values())
        # FTS5's IDF, floored the same way: a term in over half the rows weighs almost nothing.
        idf = {
            term: max(math.log((rows - found + 0.5) / (found + 0.5)), 1e-6)
            for term, found in matches.items()
        }
        average = yield from self._term_frequencies.get(
            scope_key, AVERAGE_LENGTH_MILLI, total, length_milli
        )
        exact = {term: known.rows(term) for term in plan.terms}
        rows_of_terms = {
            term: matches[term] if found is None else found for term, found in exact.items()
        }
        return KeywordStatistics(plan, idf, average / 1000, scope_rows, rows_of_terms)

    def _has_vector_table(self, dimension: int) -> bool:
        if dimension not in self._vector_tables:
            # Another process (an outbox worker) may have created it since setup().
            found = Statement("SELECT to_regclass(?)", (f"memory_vectors_{dimension}",))
            rows = self.db.run(lambda: rows_of(found), write=False)
            if not rows or rows[0][0] is None:
                return False
            self._vector_tables.add(dimension)
        return True

    def vector_search(
        self, scope: Scope, vector: FloatArray, model: str, filters: MemoryFilter, limit: int
    ) -> list[ScoredId]:
        query = np.asarray(vector, dtype=np.float32).reshape(-1)
        # A zero vector (a query with no words for the hashing embedder) has no direction:
        # its cosine is undefined, so nothing is similar to it.
        if limit <= 0 or not query.any() or not self._has_vector_table(int(query.shape[0])):
            return []
        search = Statement(*self._vector_search_sql(scope, query, model, filters, limit))
        rows = self.db.run(lambda: self._searched(search))
        # A stored zero vector (a text with no words) has a NaN cosine: never a match.
        hits = [
            ScoredId(str(r[0]), float(r[1]))
            for r in rows
            if r[1] is not None and not math.isnan(r[1])
        ]
        hits.sort(key=lambda hit: -hit.score)
        return hits

    def _searched(self, search: Statement) -> Plan[list[Any]]:
        """``search`` in a transaction set up for HNSW scans; the settings are the
        transaction's own (``set_config``'s ``is_local``), so they never reach another
        store's use of the connection.

        Iterative scans even with hnsw=False: another process may have built the index.
        Without them, a filtered HNSW scan stops after ef_search index rows, so a scope that
        is a small part of the table would get fewer rows than asked for. relaxed_order, not
        strict_order: strict ordering made some scans walk most of the graph (2.5 s against
        18 ms at p95, 3k rows); the few rows it returns out of order are re-sorted by
        vector_search.
        """
        yield Statement(
            "SELECT set_config('hnsw.iterative_scan', 'relaxed_order', true), "
            "set_config('hnsw.ef_search', ?, true)",
            (str(self.ef_search),),
        )
        return (yield search).rows

    def _vector_search_sql(
        self,
        scope: Scope,
        query: FloatArray,
        model: str,
        filters: MemoryFilter,
        limit: int,
        *,
        exact: bool = False,
    ) -> tuple[str, tuple[Any, ...]]:
        """The nearest-neighbour query (separate so tests can EXPLAIN exactly this SQL);
        ``exact`` orders by the stored 32-bit vectors' own distance, as a store without HNSW
        does (a halfvec index's store would order by its 16-bit copies)."""
        dimension = int(query.shape[0])
        where, params = filter_sql(filters, "%s", prefix="r.")
        literal = _vector_literal(query)
        operand = _hnsw_operand(dimension, self.halfvec)
        if self.hnsw and not exact and operand is not None:
            # The index's own expression, or the planner cannot use the index.
            expression, cast = operand
            order = f"v.{expression} <=> %s::{cast}"
        else:
            order = "v.embedding <=> %s::vector"
        # The scope is checked on v, whose tenant and user are copied from r's in the same
        # statement that writes the vector (and a record never changes scope); records are
        # read back through fetch(), which checks r's scope again. Repeating the scope on r
        # here made the planner reach r through its scope index once it misjudged the scope
        # as one row (no statistics yet, or a scope newer than the last ANALYZE): the whole
        # scope scanned once per candidate, 1.2 s at 2,000 records. r is joined by its key,
        # and is the record's narrow row (memory_search_rows: its filter columns on pages a
        # third the size of the records', see keel.stores._postgres_search_rows).
        sql = (
            "SELECT v.record_id, 1 - (v.embedding <=> %s::vector) AS similarity "
            f"FROM memory_vectors_{dimension} v JOIN {SEARCH_ROWS} r ON r.id = v.record_id "
            "WHERE v.tenant_id = %s AND v.user_id = %s AND v.model = %s"
            + (f" AND {where}" if where else "")
            + f" ORDER BY {order} LIMIT %s"
        )
        values = (
            literal,
            scope.tenant_id,
            scope.user_id,
            model,
            *params,
            literal,
            int(limit),
        )
        return sql, values

    def vectors(self, scope: Scope, record_ids: Sequence[str], model: str) -> dict[str, FloatArray]:
        found: dict[str, FloatArray] = {}
        if not record_ids:
            return found
        database = self.db
        # vector_send: each vector in its binary format (see _vector_from_binary).
        reads = [
            Statement(
                f"SELECT record_id, vector_send(embedding) FROM memory_vectors_{dimension} "
                "WHERE tenant_id = ? AND user_id = ? AND model = ? AND record_id = ANY(?)",
                (scope.tenant_id, scope.user_id, model, list(record_ids)),
            )
            for dimension in sorted(self._vector_tables)
        ]
        for record_id, data in database.run(lambda: _all_rows(reads), write=False):
            found[str(record_id)] = _vector_from_binary(bytes(data))
        return found

    # --- outbox -------------------------------------------------------------------------

    def complete(
        self, entries: Sequence[OutboxEntry], vectors: Sequence[FloatArray], model: str
    ) -> None:
        super().complete(entries, vectors, model)
        if entries:
            dimension = _dimension(vectors)
            self._vector_tables.add(dimension)  # committed: searches may use it now
            self._statistics.wrote({f"memory_vectors_{dimension}": len(entries)})

    def _write_vectors(
        self, entries: Sequence[OutboxEntry], vectors: Sequence[FloatArray], model: str
    ) -> Plan[None]:
        dimension = _dimension(vectors)
        table = yield from self._ensure_vector_table(dimension)
        for other in self._vector_tables - {dimension}:
            yield Statement(
                f"DELETE FROM memory_vectors_{other} WHERE record_id = ANY(?)",
                ([e.record_id for e in entries],),
            )
        # One statement for the batch's vectors (a VALUES row each, the vector in pgvector's
        # binary format: %b, BinaryVector's dumper), not one statement a vector, each parsed
        # and planned on its own. The join takes each record's scope from its row and skips
        # a record deleted since it was queued.
        pairs = [
            (entry.record_id, BinaryVector(np.asarray(vector)))
            for entry, vector in zip(entries, vectors, strict=True)
        ]
        for start in range(0, len(pairs), _VECTORS_PER_INSERT):
            chunk = pairs[start : start + _VECTORS_PER_INSERT]
            # DISTINCT ON: one row a record, as ON CONFLICT DO UPDATE needs (a record queued
            # twice in one batch gets one vector).
            yield Statement(
                f"INSERT INTO {table} (record_id, tenant_id, user_id, model, embedding) "
                "SELECT DISTINCT ON (r.id) r.id, r.tenant_id, r.user_id, ?, v.embedding FROM "
                f"(VALUES {', '.join('(?, %b::vector)' for _ in chunk)}) "
                "AS v (record_id, embedding) JOIN memory_records r ON r.id = v.record_id "
                "ORDER BY r.id ON CONFLICT (record_id) DO UPDATE SET "
                "model = EXCLUDED.model, embedding = EXCLUDED.embedding",
                (model, *(value for pair in chunk for value in pair)),
            )

    def wait_for_statistics(self, timeout: float | None = None) -> None:
        """Block until the ANALYZE runs this store started are done (tests, benchmarks)."""
        self._statistics.wait(timeout)

    def _vector_table_names(self) -> Plan[list[str]]:
        # Read from the catalogue: another process may have made a table this one never saw.
        found = yield Statement(
            "SELECT tablename FROM pg_tables WHERE tablename LIKE 'memory_vectors_%%'"
        )
        return sorted(str(name) for (name,) in found.rows if _VECTOR_TABLE.match(str(name)))

    def close(self) -> None:
        self._statistics.wait(10.0)

    def __repr__(self) -> str:
        return f"PostgresMemoryStore({self.db!r})"


def _hnsw_index_statement(table: str, operand: tuple[str, str]) -> Statement:
    """The CREATE INDEX of ``table``'s HNSW index on ``operand`` (see `_hnsw_operand`)."""
    expression, cast = operand
    if cast == "vector":
        indexed = f"{expression} vector_cosine_ops"
    else:
        indexed = f"({expression}) halfvec_cosine_ops"
    return Statement(f"CREATE INDEX IF NOT EXISTS {table}_hnsw ON {table} USING hnsw ({indexed})")


def _run_one(statement: Statement) -> Plan[None]:
    yield statement


def _all_rows(statements: Sequence[Statement]) -> Plan[list[Any]]:
    found: list[Any] = []
    for statement in statements:
        found.extend((yield statement).rows)
    return found


class _GrowthStatistics:
    """Keeps the planner's idea of each table's size within about 2x of the truth while this
    process fills it.

    The first write to a table that was never analyzed analyzes it at once (a handful of
    rows, milliseconds): until autovacuum first does, up to a minute later, the planner
    guesses that a scope holds one row, and the vector search joined its candidates to their
    records by scanning the whole scope once per candidate (0.9 s at 2,000 records).

    Autovacuum then re-analyzes a table after 10% of it changed, but only when its launcher
    next visits the database (once a minute), and later still while it works through other
    tables on a busy server. A bulk load outgrows that: 5,000 records written in four seconds
    were planned as a 1-row scope, and every keyword search walked the whole scope to rank
    a few hundred rows (17 ms instead of 3). So once this process has written as many rows to
    a table as it held when last analyzed (at least ``MIN_ROWS``), it is analyzed again, on
    keel's blocking pool (``keel._bridge.fork``) so the write that crossed the line does not
    wait: log2 of the table's growth runs, each sampling at most 30,000 rows.
    """

    MIN_ROWS = 500

    def __init__(self, database: PostgresDatabase) -> None:
        self._database = database
        self._lock = threading.Lock()
        #: Rows each table held (``reltuples``) when it was last analyzed, as far as we know.
        self._analyzed: dict[str, float] = {}
        #: Rows this process wrote to each table since then.
        self._written: dict[str, int] = {}
        #: The ANALYZE runs in flight, each set when it is done.
        self._running: dict[str, threading.Event] = {}

    def wrote(self, rows: Mapping[str, int]) -> None:
        """Note ``rows`` written to each table (committed); analyze what has outgrown its
        statistics."""
        unknown = [table for table in rows if table not in self._analyzed]
        if unknown:
            self._first_statistics(unknown)
        due: list[str] = []
        with self._lock:
            for table, count in rows.items():
                written = self._written.get(table, 0) + count
                self._written[table] = written
                known = self._analyzed.get(table)
                if (
                    known is not None
                    and table not in self._running
                    and written >= max(self.MIN_ROWS, known)
                ):
                    self._written[table] = 0
                    self._running[table] = threading.Event()
                    due.append(table)
        for table in due:
            # Not joined: wait() watches its event (close waits for it, a bounded time).
            fork(self._analyze, table)

    def _first_statistics(self, tables: list[str]) -> None:
        """ANALYZE each of ``tables`` that never was (synchronously: it is nearly empty)."""
        try:
            found = self._database.run(lambda: _analyzed_first(tables), write=False)
        except StoreError as exc:
            # Statistics only steer plans, and autovacuum takes them later anyway.
            logger.debug("ANALYZE %s failed: %s", tables, exc)
            return
        with self._lock:
            for table in tables:
                self._analyzed.setdefault(table, max(found.get(table, 0.0), 0.0))

    def _analyze(self, table: str) -> None:
        try:
            reltuples = self._database.run(lambda: _analyzed(table), write=False)
            with self._lock:
                self._analyzed[table] = max(reltuples, 0.0)
        except StoreError as exc:
            logger.debug("ANALYZE %s failed: %s", table, exc)
        finally:
            with self._lock:
                done = self._running.pop(table, None)
            if done is not None:
                done.set()

    def wait(self, timeout: float | None = None) -> None:
        """Join the ANALYZE runs in flight."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                running = list(self._running.values())
            if not running:
                return
            for done in running:
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                done.wait(remaining)
            if deadline is not None and time.monotonic() >= deadline:
                return


def _analyze_statement(table: str) -> Statement:
    return Statement('ANALYZE "{}"'.format(table.replace('"', '""')))


def _reltuples(tables: list[str]) -> Plan[dict[str, float]]:
    """Each existing table's ``reltuples`` (-1 when it was never analyzed)."""
    rows = (
        yield Statement(
            "SELECT relname, reltuples FROM pg_class WHERE oid = ANY("
            "SELECT to_regclass(name) FROM unnest(?::text[]) AS name)",
            (tables,),
        )
    ).rows
    return {str(name): float(reltuples) for name, reltuples in rows}


def _analyzed_first(tables: list[str]) -> Plan[dict[str, float]]:
    """ANALYZE each of ``tables`` never analyzed; every table's ``reltuples`` after."""
    found = yield from _reltuples(tables)
    for name, reltuples in list(found.items()):
        if reltuples < 0:
            yield _analyze_statement(name)
            found.update((yield from _reltuples([name])))
    return found


def _analyzed(table: str) -> Plan[float]:
    """ANALYZE ``table``; its ``reltuples`` after."""
    yield _analyze_statement(table)
    return (yield from _reltuples([table])).get(table, 0.0)
