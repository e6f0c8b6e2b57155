"""What a user's erasure and memory's retention say alike in SQL on both engines: a ``LIKE``
pattern for a prefix (its wildcards escaped), and deletes counted by table."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from keel.stores._sql_plan import Plan, Statement

__all__ = ["ESCAPE", "count_deleted", "like_prefix", "starts_with"]

ESCAPE = " ESCAPE '!'"
"""The escape clause that goes after ``LIKE ?`` with a `like_prefix` pattern (``!``: no
backslash, whose meaning in a literal differs between the engines' settings)."""


def like_prefix(prefix: str) -> str:
    """The ``LIKE`` pattern of the strings that start with ``prefix``, its ``%`` and ``_``
    escaped (used with `ESCAPE`). SQLite's ``LIKE`` ignores ASCII case: a caller filters
    what it finds with ``startswith``."""
    escaped = prefix.replace("!", "!!").replace("%", "!%").replace("_", "!_")
    return escaped + "%"


def starts_with(column: str, prefix: str) -> tuple[str, tuple[str, ...]]:
    """``column`` starts with ``prefix``, case and all: the condition with ``?`` markers and
    its parameters (a ``LIKE`` an index can use, then the exact prefix, since SQLite's
    ``LIKE`` ignores ASCII case)."""
    condition = f"({column} LIKE ?{ESCAPE} AND substr({column}, 1, length(?)) = ?)"
    return condition, (like_prefix(prefix), prefix, prefix)


def count_deleted(counts: dict[str, int], name: str, sql: str, params: Sequence[Any]) -> Plan[int]:
    """Run the ``DELETE`` ``sql`` and add the rows it removed to ``counts[name]``."""
    removed = int((yield Statement(sql, tuple(params))).rowcount or 0)
    counts[name] = counts.get(name, 0) + removed
    return removed
