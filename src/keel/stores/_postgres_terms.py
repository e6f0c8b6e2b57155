"""Each scope's document frequency of each word, kept by PostgreSQL itself as records come and go.

Keyword search plans with how many of a scope's records hold each query word (see
`keel.stores._keywords`). Counted from the records, that cost grew with the table: the GIN
index finds a word's rows in every scope, and each had to be read to check its scope (a count
of up to 20,000 rows a word). At 300,000 records the counts took 4,382 buffers and 29.7 ms of
server time a search. ``memory_terms`` holds the count instead: one row per scope and lexeme
(and one per scope, lexeme ``''``, for the scope's records), so a query's counts are one
indexed look-up whatever the table's size.

Triggers keep it, so no path that writes or deletes records (insert, a key's replacement,
``forget``, expiry, retention, erasure, a cascade, another process's SQL) can leave it behind.
Per statement, from its transition table: a bulk insert of 1,000 records is one upsert of
their words, sorted by key so that writers of one scope take the rows' locks in the same
order. A count that falls to zero is deleted: the table never keeps a word of a scope that
holds it nowhere (an erased user's words go with their records).

The price is on the writes: a scope's writers take turns on its common words' rows until
they commit.
"""

from __future__ import annotations

from collections.abc import Sequence

from keel.memory._records import Scope
from keel.stores._migrations import Migration
from keel.stores._sql_plan import Plan, Statement

__all__ = ["MEMORY_TERMS_MIGRATION", "ScopeTerms", "scope_terms"]

# Each row's lexemes and a '' for the row itself (the scope's record count), per scope.
_COUNTED = """
    SELECT tenant_id, user_id, term, COUNT(*) AS n FROM (
        SELECT tenant_id, user_id, '' AS term FROM {rows}
        UNION ALL
        SELECT tenant_id, user_id, unnest(tsvector_to_array(tsv)) FROM {rows}
    ) words GROUP BY tenant_id, user_id, term
"""
_SAME_KEY = "t.tenant_id = g.tenant_id AND t.user_id = g.user_id AND t.term = g.term"

MEMORY_TERMS_MIGRATION = Migration(
    "each scope's document frequency of each word, kept by triggers",
    f"""
    CREATE TABLE memory_terms (
        tenant_id TEXT NOT NULL,
        user_id TEXT NOT NULL,
        term TEXT NOT NULL,
        rows BIGINT NOT NULL,
        PRIMARY KEY (tenant_id, user_id, term)
    );
    CREATE FUNCTION memory_terms_added() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        INSERT INTO memory_terms AS t (tenant_id, user_id, term, rows)
        SELECT * FROM ({_COUNTED.format(rows="added")}) g
        ORDER BY tenant_id, user_id, term
        ON CONFLICT (tenant_id, user_id, term) DO UPDATE SET rows = t.rows + EXCLUDED.rows;
        RETURN NULL;
    END $$;
    CREATE FUNCTION memory_terms_removed() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        -- Locked in key order first, as inserts lock them, so writers never wait in a ring.
        PERFORM 1 FROM memory_terms t, ({_COUNTED.format(rows="removed")}) g
        WHERE {_SAME_KEY} ORDER BY t.tenant_id, t.user_id, t.term FOR UPDATE OF t;
        DELETE FROM memory_terms t USING ({_COUNTED.format(rows="removed")}) g
        WHERE {_SAME_KEY} AND t.rows <= g.n;
        UPDATE memory_terms t SET rows = t.rows - g.n
        FROM ({_COUNTED.format(rows="removed")}) g WHERE {_SAME_KEY};
        RETURN NULL;
    END $$;
    CREATE FUNCTION memory_terms_cleared() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        DELETE FROM memory_terms;
        RETURN NULL;
    END $$;
    CREATE TRIGGER memory_terms_insert AFTER INSERT ON memory_records
        REFERENCING NEW TABLE AS added FOR EACH STATEMENT EXECUTE FUNCTION memory_terms_added();
    CREATE TRIGGER memory_terms_delete AFTER DELETE ON memory_records
        REFERENCING OLD TABLE AS removed FOR EACH STATEMENT
        EXECUTE FUNCTION memory_terms_removed();
    -- keel never changes a record's text or scope; another client's UPDATE still counts. Per
    -- row, and only for those columns: the outbox sets each record's embedding_model.
    CREATE FUNCTION memory_terms_changed() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        DELETE FROM memory_terms t
        WHERE t.tenant_id = OLD.tenant_id AND t.user_id = OLD.user_id AND t.rows <= 1
        AND t.term = ANY(array[''] || tsvector_to_array(OLD.tsv));
        UPDATE memory_terms t SET rows = t.rows - 1
        WHERE t.tenant_id = OLD.tenant_id AND t.user_id = OLD.user_id
        AND t.term = ANY(array[''] || tsvector_to_array(OLD.tsv));
        INSERT INTO memory_terms AS t (tenant_id, user_id, term, rows)
        SELECT NEW.tenant_id, NEW.user_id, term, 1
        FROM unnest(array[''] || tsvector_to_array(NEW.tsv)) AS term ORDER BY term
        ON CONFLICT (tenant_id, user_id, term) DO UPDATE SET rows = t.rows + 1;
        RETURN NULL;
    END $$;
    CREATE TRIGGER memory_terms_update AFTER UPDATE OF text, tenant_id, user_id
        ON memory_records FOR EACH ROW
        WHEN (OLD.text IS DISTINCT FROM NEW.text OR OLD.tenant_id IS DISTINCT FROM NEW.tenant_id
            OR OLD.user_id IS DISTINCT FROM NEW.user_id)
        EXECUTE FUNCTION memory_terms_changed();
    CREATE TRIGGER memory_terms_truncate AFTER TRUNCATE ON memory_records
        FOR EACH STATEMENT EXECUTE FUNCTION memory_terms_cleared();
    INSERT INTO memory_terms (tenant_id, user_id, term, rows)
    SELECT * FROM ({_COUNTED.format(rows="memory_records")}) g;
    """,
)


class ScopeTerms:
    """A scope's record count and the document frequency of each word of a query, as
    `memory_terms` holds them; a word that is several lexemes (``e-mail``) is not there."""

    def __init__(self, scope_rows: int, words: dict[str, int | None]) -> None:
        self.scope_rows = scope_rows
        self._words = words

    def rows(self, word: str) -> int | None:
        """The scope's records holding ``word``, or None when the table cannot tell (a word
        of several lexemes, or one not asked for)."""
        return self._words.get(word)


def scope_terms(scope: Scope, words: Sequence[str]) -> Plan[ScopeTerms]:
    """One statement: the scope's records and each of ``words``' frequency.

    A word is looked up as ``plainto_tsquery`` reads it, its lexemes: none (a stop word)
    matches no record, one is a row of the table."""
    found = yield Statement(
        "SELECT w.word, cardinality(l.lexemes), COALESCE((SELECT rows FROM memory_terms t "
        "WHERE t.tenant_id = ? AND t.user_id = ? AND t.term = l.lexemes[1]), 0), "
        "COALESCE((SELECT rows FROM memory_terms t WHERE t.tenant_id = ? AND t.user_id = ? "
        "AND t.term = ''), 0) FROM unnest(?::text[]) AS w (word), "
        "LATERAL (SELECT tsvector_to_array(to_tsvector('english', w.word)) AS lexemes) l",
        (scope.tenant_id, scope.user_id, scope.tenant_id, scope.user_id, list(words)),
    )
    counts: dict[str, int | None] = {}
    scope_rows = 0
    for word, lexemes, rows, records in found.rows:
        counts[str(word)] = None if int(lexemes) > 1 else int(rows)
        scope_rows = int(records)
    if not found.rows:
        scope_rows = int(
            (
                yield Statement(
                    "SELECT COALESCE((SELECT rows FROM memory_terms WHERE tenant_id = ? "
                    "AND user_id = ? AND term = ''), 0)",
                    (scope.tenant_id, scope.user_id),
                )
            ).rows[0][0]
        )
    return ScopeTerms(scope_rows, counts)
