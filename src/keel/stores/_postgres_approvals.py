"""The approvals queue in PostgreSQL (component ``approvals``).

For stateless keel processes over one database: a decision is an ``UPDATE ... WHERE status =
'pending'``, and under READ COMMITTED a second UPDATE of the same row waits for the first to
commit, then finds the row no longer pending: of two processes deciding at once exactly one
settles the request. psycopg is imported only when a store is built.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from keel.stores._dialect import POSTGRES
from keel.stores._postgres import PostgresDatabase, apply_migrations
from keel.stores._sql_approvals import SQLApprovalStore, approval_migrations
from keel.stores._sql_plan import Plan, arun_plan

__all__ = ["POSTGRES_APPROVAL_MIGRATIONS", "PostgresApprovalStore"]

POSTGRES_APPROVAL_MIGRATIONS = approval_migrations(POSTGRES)

_T = TypeVar("_T")


class PostgresApprovalStore(SQLApprovalStore):
    """The approvals queue in PostgreSQL; applies its migrations on construction.

    Args:
        database: the [`PostgresDatabase`][] to share (the caller closes it).
    """

    dialect = POSTGRES

    def __init__(self, database: PostgresDatabase) -> None:
        self.database = database
        with database.transaction() as conn:
            apply_migrations(conn, POSTGRES_APPROVAL_MIGRATIONS)

    async def _arun(self, write: bool, plan: Callable[[], Plan[_T]]) -> _T:
        opened = self.database.atransaction() if write else self.database.aconnection()
        async with opened as conn:
            return await arun_plan(conn.cursor(), self.dialect, plan())
