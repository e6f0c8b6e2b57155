"""Ordered schema migrations, grouped by component.

Each component (core, state, memory, traces, ...) owns one ordered list of migrations; a
migration's position in its list is its version. A store's migrations are a function of the
database's dialect (``journal_migrations(db.dialect)``), or, where the engines' schemas differ
beyond spelling (memory), the engine's store class's ``migrations``. The database's
``migrate`` applies what a database lacks, records the version per component, and refuses a
database whose version for a component is newer than this code knows (it was written by a
newer keel).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Migration", "MigrationSet"]


@dataclass(frozen=True)
class Migration:
    """One schema step: SQL statements, or a function given the open connection."""

    description: str
    apply: str | Callable[[Any], None]


@dataclass(frozen=True)
class MigrationSet:
    """The ordered migrations of one component. Version N means the first N are applied."""

    component: str
    migrations: Sequence[Migration]

    @property
    def version(self) -> int:
        """The schema version this code brings the component to."""
        return len(self.migrations)
