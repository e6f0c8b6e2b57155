"""The approvals queue: one class over a SQL database, SQLite or PostgreSQL alike.

Every statement names the tenant (the primary key is ``(tenant_id, id)``: another tenant's
request with the same id is another row, never a match). A decision is one compare-and-set,
``UPDATE ... WHERE status = 'pending'``: of two deciders (two operators, or one HTTP request
sent twice) exactly one changes the row; the other reads the request as the first left it.
A request past its expiry is never shown nor decided as pending: each operation that reads
requests first marks those of its scope ``expired``, in the same transaction.

Each operation is a plan (``_sql_plan.py``), run by the database in one write transaction:
on SQLite a ``BEGIN IMMEDIATE``, so the compare-and-set holds across the threads and processes
that share the file; on PostgreSQL, under READ COMMITTED, a second UPDATE of the same row waits
for the first to commit and then finds the row no longer pending.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from keel.approvals import ApprovalDecision, ApprovalRequest, ApprovalStatus, ApprovalStore
from keel.errors import StoreError, UsageError
from keel.stores._dialect import SqlDialect
from keel.stores._migrations import Migration, MigrationSet
from keel.stores._sql_plan import Plan, Result, SQLDatabase, Statement

__all__ = ["EXPIRED_REASON", "SQLApprovalStore", "approval_migrations"]

EXPIRED_REASON = "no decision before it expired"
"""The ``status_reason`` of a request that expired."""


_DECIDED_SQL = "status IN ('approved', 'rejected', 'expired')"
"""The decided statuses, spelled once: the partial index's predicate and the queries that
use it must say it alike (SQLite uses a partial index only for a query that repeats its
terms)."""


def approval_migrations(dialect: SqlDialect) -> MigrationSet:
    """The ``approvals`` component's migrations in ``dialect``'s column types."""
    real = dialect.real_type
    return MigrationSet(
        "approvals",
        (
            Migration(
                "approval requests and their decisions, per tenant",
                f"""
                CREATE TABLE IF NOT EXISTS keel_approvals (
                    tenant_id TEXT NOT NULL,
                    id TEXT NOT NULL,
                    user_id TEXT NOT NULL,
                    session_id TEXT NOT NULL,
                    turn_id TEXT NOT NULL,
                    kind TEXT NOT NULL CHECK (kind IN ('user', 'operator', 'escalation')),
                    tool TEXT,
                    call_id TEXT,
                    arguments TEXT NOT NULL,
                    reason TEXT NOT NULL,
                    step INTEGER NOT NULL,
                    created_at {real} NOT NULL,
                    expires_at {real},
                    status TEXT NOT NULL CHECK (status IN
                        ('pending', 'approved', 'rejected', 'expired', 'cancelled')),
                    decision TEXT,
                    status_reason TEXT,
                    metadata TEXT NOT NULL,
                    PRIMARY KEY (tenant_id, id)
                );
                CREATE INDEX IF NOT EXISTS keel_approvals_queue
                    ON keel_approvals (tenant_id, status, created_at);
                CREATE INDEX IF NOT EXISTS keel_approvals_session
                    ON keel_approvals (tenant_id, session_id, status);
                CREATE INDEX IF NOT EXISTS keel_approvals_expiry
                    ON keel_approvals (status, expires_at);
                """,
            ),
            Migration(
                "a request carries its tool's arguments schema (JSON; NULL for earlier ones)",
                f"ALTER TABLE keel_approvals {dialect.add_column} arguments_schema TEXT;",
            ),
            Migration(
                "a decided request records when it was carried out; a partial index holds the "
                "decided ones left to carry out, so a carrier's pass reads only those",
                f"""
                ALTER TABLE keel_approvals {dialect.add_column} carried_out_at {real};
                CREATE INDEX IF NOT EXISTS keel_approvals_to_carry_out
                    ON keel_approvals (tenant_id, created_at, id)
                    WHERE carried_out_at IS NULL AND {_DECIDED_SQL};
                """,
            ),
        ),
    )


_COLUMNS = (
    "tenant_id, id, user_id, session_id, turn_id, kind, tool, call_id, arguments, reason, "
    "step, created_at, expires_at, status, decision, status_reason, metadata, arguments_schema, "
    "carried_out_at"
)
_NAMES = tuple(name.strip() for name in _COLUMNS.split(","))
_SETTLED: tuple[ApprovalStatus, ...] = ("approved", "rejected", "expired", "cancelled")


class SQLApprovalStore(ApprovalStore):
    """The approvals queue in a SQL database ([`SQLiteDatabase`][keel.stores.SQLiteDatabase]
    or [`PostgresDatabase`][keel.stores.PostgresDatabase]); applies its migrations on
    construction. Every operation is one write transaction (a read first expires what is
    due).

    Args:
        db: the database to share (the caller closes it).
    """

    def __init__(self, db: SQLDatabase) -> None:
        self.db = db
        db.migrate(approval_migrations(db.dialect))

    async def aadd(self, request: ApprovalRequest) -> ApprovalRequest:
        row = _row(request)
        return await self.db.arun(lambda: _add(row, request.tenant_id, request.id))

    async def aget(self, tenant_id: str, request_id: str) -> ApprovalRequest | None:
        return await self.db.arun(lambda: _get(tenant_id, request_id, time.time()))

    async def alist(
        self,
        tenant_id: str,
        *,
        user_id: str | None = None,
        session_id: str | None = None,
        statuses: Sequence[ApprovalStatus] = ("pending",),
        limit: int = 100,
    ) -> list[ApprovalRequest]:
        if limit < 1:
            raise UsageError(f"limit must be at least 1, not {limit}")
        unknown = sorted(set(statuses) - {"pending", *_SETTLED})
        if unknown:
            raise UsageError(f"unknown approval statuses {unknown}")
        if not statuses:
            return []
        clauses = ["tenant_id = ?"]
        params: list[Any] = [tenant_id]
        for column, value in (("user_id", user_id), ("session_id", session_id)):
            if value is not None:
                clauses.append(f"{column} = ?")
                params.append(value)
        condition, values = self.db.dialect.one_of("status", list(dict.fromkeys(statuses)))
        clauses.append(condition)
        sql = (
            f"SELECT {_COLUMNS} FROM keel_approvals WHERE {' AND '.join(clauses)} "
            "ORDER BY created_at, id LIMIT ?"
        )
        query = Statement(sql, (*params, *values, limit))
        return await self.db.arun(lambda: _list(tenant_id, query, time.time()))

    async def alist_to_carry_out(
        self,
        tenant_id: str,
        *,
        user_id: str | None = None,
        after: tuple[float, str] | None = None,
        limit: int = 100,
    ) -> list[ApprovalRequest]:
        if limit < 1:
            raise UsageError(f"limit must be at least 1, not {limit}")
        clauses = ["tenant_id = ?", "carried_out_at IS NULL", _DECIDED_SQL]
        params: list[Any] = [tenant_id]
        if user_id is not None:
            clauses.append("user_id = ?")
            params.append(user_id)
        if after is not None:
            clauses.append("(created_at > ? OR (created_at = ? AND id > ?))")
            params.extend((after[0], after[0], after[1]))
        sql = (
            f"SELECT {_COLUMNS} FROM keel_approvals WHERE {' AND '.join(clauses)} "
            "ORDER BY created_at, id LIMIT ?"
        )
        query = Statement(sql, (*params, limit))
        return await self.db.arun(lambda: _list(tenant_id, query, time.time()))

    async def atenants_to_carry_out(self, now: float | None = None) -> list[str]:
        at = time.time() if now is None else now
        return await self.db.arun(lambda: _tenants_to_carry_out(at))

    async def amark_carried_out(
        self, tenant_id: str, request_ids: Sequence[str], now: float | None = None
    ) -> int:
        ids = list(dict.fromkeys(request_ids))
        if not ids:
            return 0
        at = time.time() if now is None else now
        statements = []
        for batch in self.db.dialect.batches(ids):
            condition, values = self.db.dialect.one_of("id", list(batch))
            statements.append(Statement(f"{_MARK} AND {condition}", (at, tenant_id, *values)))
        return await self.db.arun(lambda: _counts(statements))

    async def adecide(
        self, tenant_id: str, request_id: str, status: ApprovalStatus, decision: ApprovalDecision
    ) -> tuple[ApprovalRequest, bool]:
        if status not in _SETTLED:
            raise UsageError(
                f"a decision settles a request: status {status!r} is not one of {list(_SETTLED)}"
            )
        params = (status, decision.model_dump_json(), tenant_id, request_id)
        return await self.db.arun(lambda: _decide(params, time.time()))

    async def acancel(self, tenant_id: str, session_id: str, reason: str) -> int:
        params = (reason, tenant_id, session_id)
        return await self.db.arun(lambda: _count(Statement(_CANCEL, params)))

    async def aexpire(self, now: float) -> int:
        return await self.db.arun(lambda: _count(Statement(_EXPIRE_ALL, (EXPIRED_REASON, now))))

    async def auser_sessions(self, tenant_id: str, user_id: str) -> list[str]:
        query = Statement(_USER_SESSIONS, (tenant_id, user_id))
        return await self.db.arun(lambda: _strings(query), write=False)

    async def aerase_user(self, tenant_id: str, user_id: str) -> dict[str, int]:
        statement = Statement(_ERASE_USER, (tenant_id, user_id))
        return {"approvals": await self.db.arun(lambda: _count(statement))}


def _row(request: ApprovalRequest) -> tuple[Any, ...]:
    decision = None if request.decision is None else request.decision.model_dump_json()
    values = request.model_dump(exclude={"decision", "metadata", "arguments_schema"})
    values["decision"] = decision
    values["metadata"] = json.dumps(request.metadata, ensure_ascii=False)
    schema = request.arguments_schema
    values["arguments_schema"] = None if schema is None else json.dumps(schema, ensure_ascii=False)
    return tuple(values[name] for name in _NAMES)


def _requests(result: Result) -> list[ApprovalRequest]:
    requests = []
    for row in result.rows:
        values = dict(zip(_NAMES, row, strict=True))
        decision = values.pop("decision")
        values["decision"] = (
            None if decision is None else ApprovalDecision.model_validate_json(decision)
        )
        values["metadata"] = json.loads(values["metadata"])
        schema = values["arguments_schema"]
        values["arguments_schema"] = None if schema is None else json.loads(schema)
        requests.append(ApprovalRequest.model_validate(values))
    return requests


def _expire_one(tenant_id: str, request_id: str, now: float) -> Statement:
    return Statement(
        _EXPIRE_ALL + " AND tenant_id = ? AND id = ?",
        (EXPIRED_REASON, now, tenant_id, request_id),
    )


def _add(row: tuple[Any, ...], tenant_id: str, request_id: str) -> Plan[ApprovalRequest]:
    created = _requests((yield Statement(_INSERT, row)))
    found = created or _requests((yield Statement(_SELECT, (tenant_id, request_id))))
    if not found:  # pragma: no cover - inserted or present in the same transaction
        raise StoreError(f"approval request {request_id!r} vanished")
    return found[0]


def _get(tenant_id: str, request_id: str, now: float) -> Plan[ApprovalRequest | None]:
    yield _expire_one(tenant_id, request_id, now)
    found = _requests((yield Statement(_SELECT, (tenant_id, request_id))))
    return found[0] if found else None


def _list(tenant_id: str, query: Statement, now: float) -> Plan[list[ApprovalRequest]]:
    yield Statement(_EXPIRE_ALL + " AND tenant_id = ?", (EXPIRED_REASON, now, tenant_id))
    return _requests((yield query))


def _tenants_to_carry_out(now: float) -> Plan[list[str]]:
    yield Statement(_EXPIRE_ALL, (EXPIRED_REASON, now))
    return [row[0] for row in (yield Statement(_TENANTS_TO_CARRY_OUT, ())).rows]


def _decide(params: tuple[Any, ...], now: float) -> Plan[tuple[ApprovalRequest, bool]]:
    tenant_id, request_id = params[2], params[3]
    # A request past its expiry is expired, whoever decides it now.
    yield _expire_one(tenant_id, request_id, now)
    settled = _requests((yield Statement(_DECIDE, params)))
    if settled:
        return settled[0], True
    found = _requests((yield Statement(_SELECT, (tenant_id, request_id))))
    if not found:
        raise KeyError(request_id)
    return found[0], False


def _count(statement: Statement) -> Plan[int]:
    return (yield statement).rowcount


def _counts(statements: Sequence[Statement]) -> Plan[int]:
    total = 0
    for statement in statements:
        total += (yield statement).rowcount
    return total


_INSERT = (
    f"INSERT INTO keel_approvals ({_COLUMNS}) VALUES ({', '.join('?' for _ in _NAMES)}) "
    f"ON CONFLICT (tenant_id, id) DO NOTHING RETURNING {_COLUMNS}"
)
_SELECT = f"SELECT {_COLUMNS} FROM keel_approvals WHERE tenant_id = ? AND id = ?"
_DECIDE = (
    "UPDATE keel_approvals SET status = ?, decision = ? "
    f"WHERE tenant_id = ? AND id = ? AND status = 'pending' RETURNING {_COLUMNS}"
)
_MARK = (
    "UPDATE keel_approvals SET carried_out_at = ? "
    f"WHERE tenant_id = ? AND carried_out_at IS NULL AND {_DECIDED_SQL}"
)
# Read from the partial index of what is left to carry out (its rows only).
_TENANTS_TO_CARRY_OUT = (
    "SELECT DISTINCT tenant_id FROM keel_approvals "
    f"WHERE carried_out_at IS NULL AND {_DECIDED_SQL} ORDER BY tenant_id"
)
_CANCEL = (
    "UPDATE keel_approvals SET status = 'cancelled', status_reason = ? "
    "WHERE tenant_id = ? AND session_id = ? AND status = 'pending'"
)
_EXPIRE_ALL = (
    "UPDATE keel_approvals SET status = 'expired', status_reason = ? "
    "WHERE status = 'pending' AND expires_at IS NOT NULL AND expires_at <= ?"
)


_USER_SESSIONS = (
    "SELECT DISTINCT session_id FROM keel_approvals WHERE tenant_id = ? AND user_id = ?"
)
_ERASE_USER = "DELETE FROM keel_approvals WHERE tenant_id = ? AND user_id = ?"


def _strings(query: Statement) -> Plan[list[str]]:
    return sorted(str(value) for (value,) in (yield query).rows)
