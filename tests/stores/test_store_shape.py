"""Each store is one class over its database object: the store modules run their SQL as plans
through the database's own API, and a per-engine module holds only its engine's difference."""

from __future__ import annotations

import re
from pathlib import Path

import keel.stores
from keel.stores import (
    PostgresMemoryStore,
    SQLApprovalStore,
    SQLiteMemoryStore,
    SQLiteVaultStore,
    SQLToolJournal,
    SQLTraceStore,
    SQLVaultStore,
)
from keel.stores._sql_memory import SQLMemoryStore

STORES = Path(keel.stores.__file__).parent

# The journal, approvals, traces, memory and vault modules, and what each may reach of its
# database beyond run / arun / migrate / acall (the pipeline needs a connection of its own).
STORE_MODULES = {
    "_sql_journal.py": (),
    "_sql_approvals.py": (),
    "_sql_vault.py": (),
    "_sqlite_vault.py": (),
    "_sql_traces.py": (),
    "_postgres_traces.py": ("transaction", "atransaction"),
    "_sql_memory.py": (),
    "_sqlite_memory.py": (),
    "_postgres_memory.py": (),
}

# How stores reached their connections before they ran plans, and SQL run beside the plans.
CONNECTION_HOOKS = re.compile(
    r"def (_write|_read|_connection|_reading|_cursor|_run|_arun|_run_twin|_execute|arun)\("
    r"|asyncio\.to_thread|threading\.Thread\("
)
DATABASE_CALL = re.compile(
    r"(?:db|database)\.(transaction|atransaction|translated|connection|aconnection|snapshot"
    r"|setup)\("
)


def test_store_modules_use_only_the_database_objects_api() -> None:
    for name, allowed in STORE_MODULES.items():
        text = (STORES / name).read_text()
        assert not CONNECTION_HOOKS.search(text), (name, CONNECTION_HOOKS.search(text))
        reached = {match.group(1) for match in DATABASE_CALL.finditer(text)}
        assert reached <= set(allowed), (name, reached - set(allowed))


def test_the_journal_and_the_approvals_queue_are_one_class_each() -> None:
    for store in (SQLToolJournal, SQLApprovalStore):
        # keel's own subclasses only: a test may subclass one to inject a fault.
        keels = [cls for cls in store.__subclasses__() if cls.__module__.startswith("keel.")]
        assert keels == [], store


def test_engine_subclasses_are_the_engine_differences_only() -> None:
    assert SQLVaultStore.__subclasses__() == [SQLiteVaultStore]
    # keel's own (a test may subclass a store: the migration tests' older schema does)
    shipped = [c for c in SQLTraceStore.__subclasses__() if c.__module__.startswith("keel.")]
    assert {c.__name__ for c in shipped} <= {"PostgresTraceStore"}
    assert set(SQLMemoryStore.__subclasses__()) == {SQLiteMemoryStore, PostgresMemoryStore}
    # What the SQLite vault adds to the shared store: secure delete and the log's purge (after
    # a forget and after a user's whole erasure).
    assert set(vars(SQLiteVaultStore)) - set(vars(object)) - {"__annotations__"} <= {
        "__init__",
        "_run_write",
        "drop_key_check",
        "forget",
        "erase_user",
        "purge_log",
        "__static_attributes__",
        "__firstlineno__",
        "__abstractmethods__",
        "_abc_impl",
        "__module__",
    }
