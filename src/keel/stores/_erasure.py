"""One user's erasure across every store: [`erase_user`][keel.stores.erase_user].

``keel users erase TENANT USER`` and ``POST /v1/users/{user_id}/erase`` (a tenant's operator
key) run it. What goes, for ``user_id`` of ``tenant_id`` only (another tenant's user of the
same id is never touched):

- the sessions whose state names the user as their owner: every checkpoint, the head, the
  lease (the state store: SQLite, PostgreSQL or Redis);
- the tool journal's entries and step decisions of those sessions (and of sessions the user's
  traces, approvals or memories name whose state is gone already);
- the approval requests of the user, whatever their status;
- the user's trace runs with their steps;
- the user's memory: records, vectors, keyword index entries (SQLite's FTS5 index is merged,
  so no old segment keeps their words), outbox rows;
- the PII vault's rows of the user: the data key and every value, numbers included;
- what the caller adds (``extra``: the service's API keys of the user and their web sessions).

Each store's part is one transaction, and idempotent; the sessions are found before anything is
deleted, the journal (which knows no user) goes first and the stores that name the user after
it. Killed half-way, run it again: it finds what is left and finishes the job.

The erasure is journaled without the user: a row of ``keel_erasures`` holds a random id, the
tenant, who asked (``cli`` or the operator key's id), when it started and finished, and the
counts per store and table; never the user's id, a session id or anything they wrote. A row
left without ``finished_at`` is an erasure that was interrupted; its rerun writes its own row.

What no statement can reach is said in ``docs/privacy.md``: PostgreSQL's deleted tuples stay in
its files until a vacuum reuses them (and in its write-ahead log, replicas and backups); the
vault's values there are sealed, and final once the master key is rotated away.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from keel._bridge import run_blocking, run_sync
from keel.errors import UsageError
from keel.state._erasure import tenant_key_prefix, user_session_keys
from keel.stores._migrations import Migration, MigrationSet
from keel.stores._sql_plan import Plan, SQLDatabase, Statement

if TYPE_CHECKING:
    from keel.stores._open import Backends

__all__ = ["ERASURE_STORES", "ErasureReport", "UserErasure", "aerase_user", "erase_user"]

UserErasure = Callable[[str, str], Mapping[str, int]]
"""A store the caller erases a user from too: ``(tenant_id, user_id) -> rows removed by
table``, idempotent."""

ERASURE_STORES = ("journal", "state", "approvals", "traces", "memory", "vault")
"""The stores an erasure goes through, in its order."""


def erasure_migrations(real: str) -> MigrationSet:
    """The ``erasures`` component: the audit rows of users' erasures (no user in them)."""
    return MigrationSet(
        "erasures",
        (
            Migration(
                "one audit row per erasure of a user: counts only, never the user",
                f"""
                CREATE TABLE IF NOT EXISTS keel_erasures (
                    erasure_id TEXT PRIMARY KEY,
                    tenant_id TEXT NOT NULL,
                    requested_by TEXT NOT NULL,
                    started_at {real} NOT NULL,
                    finished_at {real},
                    removed TEXT
                );
                """,
            ),
        ),
    )


@dataclass(frozen=True)
class ErasureReport:
    """What one erasure removed, in numbers only."""

    erasure_id: str
    """The id of its audit row in ``keel_erasures``."""
    tenant_id: str
    removed: dict[str, dict[str, int]] = field(default_factory=dict)
    """Rows (keys, for Redis) removed, by store and table: ``{"state": {"sessions": 2, ...}}``."""

    @property
    def total(self) -> int:
        """Every row removed, all stores together."""
        return sum(sum(tables.values()) for tables in self.removed.values())

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data (the CLI's ``--json``, the operator route's body)."""
        return {
            "erasure_id": self.erasure_id,
            "tenant_id": self.tenant_id,
            "removed": self.removed,
            "total": self.total,
        }


def erase_user(
    backends: Backends,
    tenant_id: str,
    user_id: str,
    *,
    requested_by: str = "cli",
    extra: Mapping[str, UserErasure] | None = None,
) -> ErasureReport:
    """Erase ``user_id`` of ``tenant_id`` from every store of ``backends`` (see the module
    docstring), and from ``extra`` (name -> eraser); a report of what went, by store and
    table. Sync twin of [`aerase_user`][keel.stores.aerase_user], for code off an event loop.

    Raises:
        UsageError: an empty tenant or user, or ``backends`` opened without a store an erasure
            needs (open them all: ``Backends.open(...)`` without ``only=``).
    """
    return run_sync(
        aerase_user(backends, tenant_id, user_id, requested_by=requested_by, extra=extra)
    )


async def aerase_user(
    backends: Backends,
    tenant_id: str,
    user_id: str,
    *,
    requested_by: str = "cli",
    extra: Mapping[str, UserErasure] | None = None,
) -> ErasureReport:
    """Async twin of [`erase_user`][keel.stores.erase_user]: the stores' work runs on keel's
    blocking pool (the approvals queue's on the loop, as it is async)."""
    for name, value in (("tenant", tenant_id), ("user", user_id)):
        if not isinstance(value, str) or not value.strip():
            raise UsageError(f"a user's erasure needs a {name} id, got {value!r}")
    sql = backends.sql
    journal, state, approvals, traces = (
        backends.journal,
        backends.state.backend,
        backends.approvals,
        backends.traces,
    )
    # Built on the SQL database where memory or the vault did not open: no key, no embedder.
    memory, vault = await run_blocking(lambda: (backends.memory_store, backends.vault_store))
    erasure_id = uuid.uuid4().hex
    await run_blocking(_audit_start, sql, erasure_id, tenant_id, requested_by)

    # Found before anything goes: the sessions the user's other rows name.
    named = set(await run_blocking(traces.user_sessions, tenant_id, user_id))
    named.update(await approvals.auser_sessions(tenant_id, user_id))
    if memory is not None:
        named.update(await run_blocking(memory.user_sessions, tenant_id, user_id))
    prefix = tenant_key_prefix(tenant_id)
    also = sorted(prefix + session_id for session_id in named)
    owned, journaled = await run_blocking(user_session_keys, state, tenant_id, user_id, also=also)

    removed: dict[str, dict[str, int]] = {}
    # The journal knows no user: it goes while its sessions can still be found.
    removed["journal"] = await run_blocking(journal.erase_sessions, journaled)
    removed["state"] = await run_blocking(state.erase_sessions, owned)
    removed["approvals"] = await approvals.aerase_user(tenant_id, user_id)
    removed["traces"] = await run_blocking(traces.erase_user, tenant_id, user_id)
    removed["memory"] = (
        {} if memory is None else await run_blocking(memory.erase_user, tenant_id, user_id)
    )
    removed["vault"] = await run_blocking(vault.erase_user, tenant_id, user_id)
    for name, erase in (extra or {}).items():
        removed[name] = dict(await run_blocking(erase, tenant_id, user_id))
    removed = {store: dict(tables) for store, tables in removed.items()}
    await run_blocking(_audit_finish, sql, erasure_id, removed)
    return ErasureReport(erasure_id=erasure_id, tenant_id=tenant_id, removed=removed)


def _migrated(sql: SQLDatabase) -> SQLDatabase:
    sql.migrate(erasure_migrations(sql.dialect.real_type))
    return sql


def _audit_start(sql: SQLDatabase, erasure_id: str, tenant_id: str, requested_by: str) -> None:
    params = (erasure_id, tenant_id, requested_by, time.time())
    statement = Statement(
        "INSERT INTO keel_erasures (erasure_id, tenant_id, requested_by, started_at) "
        "VALUES (?, ?, ?, ?)",
        params,
    )
    _migrated(sql).run(lambda: _run(statement))


def _audit_finish(sql: SQLDatabase, erasure_id: str, removed: dict[str, dict[str, int]]) -> None:
    statement = Statement(
        "UPDATE keel_erasures SET finished_at = ?, removed = ? WHERE erasure_id = ?",
        (time.time(), json.dumps(removed, sort_keys=True), erasure_id),
    )
    sql.run(lambda: _run(statement))


def _run(statement: Statement) -> Plan[None]:
    yield statement
