"""``--database``: every command that reads keel's database can be pointed at another one, and
a database named there is opened, never made, unless the user asks for a new one."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from keel.testing.servers import free_port
from tests.cli import keel_process


def _keel(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return keel_process(*args, stdin=stdin, env={"KEEL_EMBEDDER": "hashing:64"})


def _one_error_line(result: subprocess.CompletedProcess[str], *says: str) -> None:
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for text in says:
        assert text in lines[0], lines[0]


@pytest.fixture
def other_database(tmp_path: Path) -> str:
    """A database outside the data directory, made by a chat told to create it."""
    url = f"sqlite:///{tmp_path / 'elsewhere' / 'other.db'}"
    (tmp_path / "elsewhere").mkdir()
    made = _keel("chat", "--database", url, "--create", "-m", "scripted:echo", stdin="hello\n")
    assert made.returncode == 0, made.stderr
    return url


def test_every_command_that_reads_the_database_takes_database(other_database: str) -> None:
    def run(*args: str) -> dict[str, object]:
        result = _keel(*args, "--database", other_database, "--json")
        assert result.returncode == 0, (args, result.stderr)
        payload: dict[str, object] = json.loads(result.stdout.strip().splitlines()[-1])
        return payload

    listed = run("runs", "list")
    assert listed["count"] == 1
    run_id = listed["runs"][0]["run_id"]  # type: ignore[index]
    assert run("runs", "show", run_id[:8])["run"]["run_id"] == run_id  # type: ignore[index]
    assert run("runs", "stats")["sessions"][0]["model_calls"] == 1  # type: ignore[index]
    assert run("runs", "prune", "--older-than", "30d")["deleted_runs"] == 0
    assert run("tools", "in-doubt")["in_doubt"] == []
    assert sum(run("memory", "status")["counts"].values()) >= 1  # type: ignore[attr-defined]
    assert run("state", "sessions")["sessions"] == ["default/chat"]
    assert run("keys", "list")["keys"] == []
    checks = {check["name"]: check for check in run("doctor")["checks"]}  # type: ignore[attr-defined]
    assert checks["database"]["detail"].startswith(other_database)
    # The default database (the data directory's) holds none of it.
    default = _keel("runs", "list", "--json")
    assert default.returncode == 0 and json.loads(default.stdout)["count"] == 0


@pytest.mark.parametrize(
    "command",
    [
        ("chat", "-m", "scripted:echo"),
        ("runs", "list"),
        ("runs", "stats"),
        ("tools", "in-doubt"),
        ("memory", "status"),
        ("state", "sessions"),
        ("keys", "list"),
        ("ui",),
        ("serve",),
    ],
)
def test_a_mistyped_path_is_an_error_and_creates_nothing(
    command: tuple[str, ...], tmp_path: Path
) -> None:
    missing = tmp_path / "no" / "such" / "dir" / "x.db"
    result = _keel(*command, "--database", f"sqlite:///{missing}", stdin="hello\n")
    _one_error_line(result, f"no database at {missing}", "does not exist")
    assert not (tmp_path / "no").exists()


def test_an_existing_directory_without_the_file_is_refused_too(tmp_path: Path) -> None:
    missing = tmp_path / "typo.db"
    chat = _keel("chat", "-m", "scripted:echo", "--database", f"sqlite:///{missing}")
    _one_error_line(chat, f"no database at {missing}", "--create")
    viewer = _keel("ui", "--database", f"sqlite:///{missing}")
    _one_error_line(viewer, f"no database at {missing}", "check the path")
    assert not missing.exists()


def test_the_default_database_and_create_make_one(tmp_path: Path) -> None:
    default = _keel("runs", "list")
    assert default.returncode == 0, default.stderr
    assert (tmp_path / "data" / "keel.db").exists()
    new = tmp_path / "new.db"
    made = _keel("chat", "-m", "scripted:echo", "--database", f"sqlite:///{new}", "--create")
    assert made.returncode == 0, made.stderr
    assert new.exists()


@pytest.mark.parametrize(
    "command",
    [("runs", "list"), ("chat", "--no-memory", "-m", "scripted:echo")],
    ids=["sync-pool", "async-pool"],
)
def test_a_postgres_server_that_is_not_there_fails_at_once_in_one_line(
    command: tuple[str, ...],
) -> None:
    url = f"postgres://nobody@127.0.0.1:{free_port()}/x"
    started = time.monotonic()
    result = _keel(*command, "--database", url, stdin="hello\n")
    took = time.monotonic() - started
    # Exit 1, as every other store error; one line saying why; no pool retrying for 30 s
    # (a generous bound: it takes about a second, the pool's wait took 30.6).
    assert result.returncode == 1, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert f"cannot connect to PostgreSQL at {url.rpartition('@')[2]}" in lines[0], lines[0]
    assert "Connection refused" in lines[0], lines[0]
    assert took < 15, f"took {took:.1f} s"


def test_a_password_in_database_is_warned_of_and_never_printed() -> None:
    """``--database postgresql://user:PASSWORD@...`` puts the password where ``ps`` shows it
    to every user of the machine; the deployment page says to keep it in ``KEEL_DATABASE``,
    and the command said nothing."""
    url = f"postgresql://keel:s3cret-pw@127.0.0.1:{free_port()}/x"
    result = _keel("runs", "list", "--database", url)
    assert result.returncode == 1, result.stdout + result.stderr
    said = " ".join(result.stderr.split())
    assert said.startswith("warning: --database holds a password, which ps shows"), said
    assert "KEEL_DATABASE" in said and "s3cret-pw" not in said
