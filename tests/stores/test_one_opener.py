"""One path builds stores: outside the opener (``stores/_open.py``), no module of keel
constructs a database object or a store class; it asks [`Backends.open`][] (or the
``vault_store`` / ``memory_store`` it builds on its database) for one."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import keel
import keel.stores
from keel.approvals import ApprovalStore
from keel.memory import MemoryStore
from keel.privacy import VaultStore
from keel.state import StateBackend
from keel.stores import PostgresDatabase, SQLiteDatabase
from keel.stores import _open as opener
from keel.stores._postgres_memory import PostgresMemoryStore
from keel.stores._postgres_traces import PostgresTraceStore
from keel.stores._sqlite_memory import SQLiteMemoryStore
from keel.tools import ToolJournal
from keel.tracing import TraceStore

SOURCE = Path(keel.__file__).parent
OPENER = Path(opener.__file__)
INTERFACES = (StateBackend, ToolJournal, ApprovalStore, TraceStore, MemoryStore, VaultStore)


def _store_classes() -> set[str]:
    """The database objects, and every class of ``keel.stores`` behind a store interface."""
    # Loaded on first use (psycopg; numpy for memory's), so not among the modules' names.
    lazy = (PostgresTraceStore, SQLiteMemoryStore, PostgresMemoryStore)
    names = {SQLiteDatabase.__name__, PostgresDatabase.__name__, *(c.__name__ for c in lazy)}
    modules = [keel.stores, opener]
    for module in modules:
        for name, value in vars(module).items():
            if (
                inspect.isclass(value)
                and issubclass(value, INTERFACES)
                and value.__module__.startswith("keel.stores")
            ):
                names.add(name)
    return names


def _constructions(path: Path, classes: set[str]) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
        if name in classes:
            found.append(f"{path.relative_to(SOURCE)}:{node.lineno} {name}(...)")
    return found


def test_the_store_classes_are_known() -> None:
    classes = _store_classes()
    assert {
        "SQLiteDatabase",
        "PostgresDatabase",
        "SQLStateBackend",
        "RedisStateBackend",
        "SQLToolJournal",
        "SQLApprovalStore",
        "SQLTraceStore",
        "PostgresTraceStore",
        "SQLiteMemoryStore",
        "PostgresMemoryStore",
        "SQLVaultStore",
        "SQLiteVaultStore",
        "_SQLStateAlone",
    } <= classes


def test_no_module_but_the_opener_constructs_a_store() -> None:
    classes = _store_classes()
    outside = [
        found
        for path in sorted(SOURCE.rglob("*.py"))
        if path != OPENER
        for found in _constructions(path, classes)
    ]
    assert outside == [], "build stores through Backends.open (stores/_open.py): " + ", ".join(
        outside
    )


def test_the_opener_is_where_they_are_built() -> None:
    # The scan reads calls as written: it finds the opener's own constructions.
    assert len(_constructions(OPENER, _store_classes())) >= 10
