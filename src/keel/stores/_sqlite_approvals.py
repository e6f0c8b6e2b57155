"""The approvals queue in the embedded SQLite database (component ``approvals``).

It lives in the same file as the checkpoints and the tool journal. Every operation is one
``BEGIN IMMEDIATE`` transaction, so a decision's compare-and-set holds across the threads and
processes that share the file.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from keel.stores._dialect import SQLITE
from keel.stores._sql_approvals import SQLApprovalStore, approval_migrations
from keel.stores._sql_plan import Plan, run_plan
from keel.stores._sqlite import SQLiteDatabase

__all__ = ["APPROVAL_MIGRATIONS", "SQLiteApprovalStore"]

APPROVAL_MIGRATIONS = approval_migrations(SQLITE)

_T = TypeVar("_T")


class SQLiteApprovalStore(SQLApprovalStore):
    """The approvals queue in a [`SQLiteDatabase`][] (applies its migrations)."""

    dialect = SQLITE

    def __init__(self, db: SQLiteDatabase) -> None:
        self.db = db
        db.setup(APPROVAL_MIGRATIONS)

    def _run(self, write: bool, plan: Callable[[], Plan[_T]]) -> _T:
        with self.db.transaction() if write else self.db.translated() as conn:
            return run_plan(conn.cursor(), self.dialect, plan())

    async def _arun(self, write: bool, plan: Callable[[], Plan[_T]]) -> _T:
        return await self.db.acall(lambda: self._run(write, plan))
