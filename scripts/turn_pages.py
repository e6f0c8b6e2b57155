"""Pages, statements and commits a memory-off turn writes to SQLite (load-independent).

The workload of ``keel bench turns --no-memory`` (as ``scripts/turn_instructions.py``): one
session, the scripted model calling the bench's sync ``lookup`` tool once and answering.
``--warm`` turns run first; the write-ahead log is then checkpointed away, ``--count`` turns
run (the log not checkpointed meanwhile), and each frame the log holds is named by the b-tree
(table or index) its page belongs to (SQLite's ``dbstat`` table), per turn::

    PYTHONPATH=src python scripts/turn_pages.py --warm 30 --count 20

Statements are those SQLite traces on the agent's connections; commits are the ``COMMIT``s
and the writes run outside a transaction (each one its own).
"""

from __future__ import annotations

import argparse
import collections
import sqlite3
import struct
import tempfile
from pathlib import Path

from turn_instructions import bench_agent

from keel.bench._react import question
from keel.stores import SQLiteDatabase

_WRITES = ("INSERT", "UPDATE", "DELETE", "REPLACE")


def _frames(database: Path) -> list[str]:
    """The b-tree of each page the write-ahead log holds, one per frame."""
    wal = (database.parent / (database.name + "-wal")).read_bytes()
    page_size = struct.unpack(">I", wal[8:12])[0]
    pages = [
        struct.unpack(">I", wal[offset : offset + 4])[0]
        for offset in range(32, len(wal) - page_size - 23, 24 + page_size)
    ]
    reader = sqlite3.connect(database)
    try:
        owner = dict(reader.execute("SELECT pageno, name FROM dbstat"))
    finally:
        reader.close()
    return [str(owner.get(page, "?")) for page in pages]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--warm", type=int, default=30)
    parser.add_argument("--count", type=int, default=20)
    options = parser.parse_args()

    with tempfile.TemporaryDirectory() as directory:
        agent = bench_agent(Path(directory))
        try:
            for turn in range(options.warm):
                agent.handle_sync("bench", "user", question(turn))
            assert agent.backends is not None
            db = agent.backends.sql
            assert isinstance(db, SQLiteDatabase)
            database = Path(db.path)
            with sqlite3.connect(database) as checkpointer:
                checkpointer.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
            statements: list[str] = []
            commits = [0]

            def tracing(conn: sqlite3.Connection) -> None:
                def seen(sql: str) -> None:
                    statements.append(sql)
                    word = sql.lstrip().split(None, 1)[0].upper()
                    if word == "COMMIT" or (word in _WRITES and not conn.in_transaction):
                        commits[0] += 1

                conn.set_trace_callback(seen)

            for conn in db._connections:
                # The log kept whole while counting (SQLite would checkpoint it at 1,000 pages
                # and write over it from its start).
                conn.execute("PRAGMA wal_autocheckpoint = 0")
                tracing(conn)
            for turn in range(options.warm, options.warm + options.count):
                agent.handle_sync("bench", "user", question(turn))
            frames = _frames(database)
        finally:
            agent.close()
    count = options.count
    print(
        f"{count} turns: WAL frames {len(frames) / count:.2f} a turn, statements "
        f"{len(statements) / count:.2f}, commits {commits[0] / count:.2f}"
    )
    for name, frames_of in collections.Counter(frames).most_common():
        print(f"  {name}: {frames_of / count:.2f}")


if __name__ == "__main__":
    main()
