"""keel through PgBouncer in transaction pooling mode, as managed PostgreSQL is reached: the
PostgreSQL conformance suites (state, memory, approvals, vault, traces, LangGraph's
checkpointer kit) and ``keel demo`` pass there, besides their direct runs elsewhere. Between two
transactions a connection of keel's may land on another server session, so nothing keel does
may rely on a session: no server-side prepared statements, no session settings or locks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from keel.stores import PostgresDatabase, PostgresMemoryStore, SQLVaultStore
from keel.stores._postgres_traces import PostgresTraceStore
from keel.testing.approvals_conformance import ApprovalStoreConformance
from keel.testing.langgraph import conformance_failures
from keel.testing.memory_conformance import MemoryStoreConformance
from keel.testing.state_conformance import StateBackendConformance
from keel.testing.topologies import PREPARED_POOL, PgBouncer
from keel.testing.trace_conformance import TraceStoreConformance
from keel.testing.vault_conformance import VaultStoreConformance
from keel.tracing import TraceStore

pytestmark = pytest.mark.postgres

SRC = str(Path(__file__).resolve().parents[2] / "src")


def test_the_pooler_breaks_a_client_that_prepares_statements(pgbouncer_server: PgBouncer) -> None:
    """What LangGraph's own Postgres checkpointer meets behind PgBouncer (langgraph#2576): two
    clients share one server session between transactions, and the second one's prepared
    statement collides with the first one's. keel's connections, made the same way, do not."""
    import psycopg

    url = pgbouncer_server.url(PREPARED_POOL)
    with (
        psycopg.connect(url, autocommit=True, prepare_threshold=0) as first,
        psycopg.connect(url, autocommit=True, prepare_threshold=0) as second,
    ):
        first.execute("SELECT 1")
        with pytest.raises(psycopg.errors.DuplicatePreparedStatement):
            second.execute("SELECT 2")
    with PostgresDatabase(url) as one, PostgresDatabase(url) as other:
        for _ in range(3):
            for database in (one, other):
                with database.connection() as conn:
                    assert conn.execute("SELECT 1").fetchone() == (1,)


class TestStateThroughPgBouncer(StateBackendConformance):
    @pytest.fixture
    def state_backend_url(self, pgbouncer_url: str) -> str:
        return pgbouncer_url


class TestMemoryThroughPgBouncer(MemoryStoreConformance):
    @pytest.fixture
    def make_store(self, pgbouncer_url: str) -> Iterator[object]:
        with ExitStack() as databases:
            yield lambda: PostgresMemoryStore(
                databases.enter_context(PostgresDatabase(pgbouncer_url))
            )


class TestApprovalsThroughPgBouncer(ApprovalStoreConformance):
    @pytest.fixture
    def approvals_database_url(self, pgbouncer_url: str) -> str:
        return pgbouncer_url


class TestVaultThroughPgBouncer(VaultStoreConformance):
    @pytest.fixture
    def make_store(self, pgbouncer_url: str) -> Iterator[object]:
        with ExitStack() as databases:
            yield lambda: SQLVaultStore(databases.enter_context(PostgresDatabase(pgbouncer_url)))


class TestTracesThroughPgBouncer(TraceStoreConformance):
    @pytest.fixture
    def trace_store(self, pgbouncer_url: str) -> Iterator[TraceStore]:
        with PostgresDatabase(pgbouncer_url, max_size=4) as database:
            store = PostgresTraceStore(database)
            store.setup()
            yield store
            store.close()


def test_langgraph_conformance_passes_through_pgbouncer(pgbouncer_url: str) -> None:
    assert conformance_failures(pgbouncer_url) == {}


@pytest.mark.redis
def test_keel_demo_passes_through_pgbouncer(tmp_path: Path, pgbouncer_url: str) -> None:
    """``keel demo`` on a PostgreSQL reached through PgBouncer: its workers, the one started
    after the SIGKILL too, book every trip once."""
    options = ["--trips", "3", "--side-questions", "1", "--no-memory", "--json"]
    result = subprocess.run(
        [sys.executable, "-m", "keel", "demo", "--database", pgbouncer_url, *options],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])},
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["passed"] and report["resumed_after_kill"] and report["double_bookings"] == 0
    assert f":{pgbouncer_url.split(':')[-1].split('/')[0]}/" in report["database"]
