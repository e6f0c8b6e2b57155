"""The columns a PostgreSQL memory search reads, one narrow row a record, kept by triggers.

A keyword search ranks up to 1,500 rows a query, and a vector search checks the filters of
its 100 candidates; both read each row they touch from its table, a page at random. From
``memory_records`` that page is the wide record: its text, content hash, metadata and
provenance, on pages kept half full so that the outbox's ``embedding_model`` update stays on
its page (about 1,030 bytes of heap a record). Over many searches every page of that heap is
read, so all of it had to stay cached: 3.1 GB at 3M records.

``memory_search_rows`` holds what those statements read and nothing else: the record's
``seq`` and id, its scope, the columns a `MemoryFilter` tests and its words' ``tsvector``,
about 300 bytes a record on full pages, with the full-text (GIN) index that was
``memory_records``'s. A search reads the same number of rows from it, on pages of a table a
third the size; the records' heap is read only for the few records a search returns.

Triggers keep it, as they keep ``memory_terms``, so no path that writes records (keel's
inserts, a key's replacement, expiry, supersession, erasure, another client's SQL) can leave
it behind: per statement from the transition tables for inserts and deletes, per row for an
update of a mirrored column (the outbox's ``embedding_model`` updates fire nothing).
"""

from __future__ import annotations

from keel.stores._migrations import Migration

__all__ = ["MEMORY_SEARCH_ROWS_MIGRATION", "SEARCH_ROWS"]

#: The table keyword search ranks and vector search checks its filters on.
SEARCH_ROWS = "memory_search_rows"

# Fixed-width columns first, then the text ones (fewer alignment gaps).
_COLUMNS = (
    "seq",
    "created_at",
    "valid_to",
    "expires_at",
    "turn",
    "id",
    "tenant_id",
    "user_id",
    "kind",
    "type",
    "session_id",
    "key",
    "tsv",
)
_LISTED = ", ".join(_COLUMNS)
# An update of any of these (text: the tsvector is generated from it) is copied over.
_WATCHED = ", ".join(column for column in _COLUMNS if column != "tsv") + ", text"

MEMORY_SEARCH_ROWS_MIGRATION = Migration(
    "the columns a search reads, one narrow row a record (memory_search_rows), kept by triggers",
    f"""
    CREATE TABLE {SEARCH_ROWS} (
        seq BIGINT PRIMARY KEY,
        created_at DOUBLE PRECISION NOT NULL,
        valid_to DOUBLE PRECISION,
        expires_at DOUBLE PRECISION,
        turn INTEGER,
        id TEXT NOT NULL UNIQUE,
        tenant_id TEXT NOT NULL,
        user_id TEXT NOT NULL,
        kind TEXT NOT NULL,
        type TEXT NOT NULL,
        session_id TEXT,
        key TEXT,
        tsv tsvector
    );
    CREATE FUNCTION memory_search_rows_added() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        INSERT INTO {SEARCH_ROWS} ({_LISTED}) SELECT {_LISTED} FROM added;
        RETURN NULL;
    END $$;
    CREATE FUNCTION memory_search_rows_removed() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        DELETE FROM {SEARCH_ROWS} s USING removed r WHERE s.seq = r.seq;
        RETURN NULL;
    END $$;
    CREATE FUNCTION memory_search_rows_changed() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        UPDATE {SEARCH_ROWS} SET ({_LISTED}) = ({", ".join(f"NEW.{c}" for c in _COLUMNS)})
        WHERE seq = OLD.seq;
        RETURN NULL;
    END $$;
    CREATE FUNCTION memory_search_rows_cleared() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        DELETE FROM {SEARCH_ROWS};
        RETURN NULL;
    END $$;
    CREATE TRIGGER memory_search_rows_insert AFTER INSERT ON memory_records
        REFERENCING NEW TABLE AS added FOR EACH STATEMENT
        EXECUTE FUNCTION memory_search_rows_added();
    CREATE TRIGGER memory_search_rows_delete AFTER DELETE ON memory_records
        REFERENCING OLD TABLE AS removed FOR EACH STATEMENT
        EXECUTE FUNCTION memory_search_rows_removed();
    CREATE TRIGGER memory_search_rows_update AFTER UPDATE OF {_WATCHED}
        ON memory_records FOR EACH ROW EXECUTE FUNCTION memory_search_rows_changed();
    CREATE TRIGGER memory_search_rows_truncate AFTER TRUNCATE ON memory_records
        FOR EACH STATEMENT EXECUTE FUNCTION memory_search_rows_cleared();
    INSERT INTO {SEARCH_ROWS} ({_LISTED}) SELECT {_LISTED} FROM memory_records ORDER BY seq;
    CREATE INDEX {SEARCH_ROWS}_tsv ON {SEARCH_ROWS} USING GIN (tsv)
        WITH (gin_pending_list_limit = 256);
    -- A scope's rows, as the records' scope indexes found them: without it a small scope in
    -- a shared table was ranked by reading every narrow row (a sequential scan: 336 pages
    -- for 5 rows among 20,000). Deduplicated (two columns, no row's own value): a few bytes
    -- a record.
    CREATE INDEX {SEARCH_ROWS}_scope ON {SEARCH_ROWS} (tenant_id, user_id);
    DROP INDEX memory_records_tsv;
    -- Statistics for the rows copied; an empty table is left never analyzed, as a new one
    -- is: analyzed empty, the planner took it for a page of rows and scanned it whole for
    -- each vector candidate once it grew (the store analyzes it on its first write).
    DO $$ BEGIN
        IF EXISTS (SELECT 1 FROM {SEARCH_ROWS}) THEN ANALYZE {SEARCH_ROWS}; END IF;
    END $$;
    """,
)
