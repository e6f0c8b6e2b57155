"""The embedded database failing as disks do: full, deleted under keel, read-only.

Each failure is a typed ``StoreError`` with the SQLite error on ``__cause__``, never a raw
``sqlite3`` error, and never the error of a rollback that hid the real one.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from keel.errors import (
    BackendUnavailableError,
    DatabaseFileError,
    DatabaseReadOnlyError,
    StorageFullError,
    StoreError,
)
from keel.runtime import Agent
from keel.settings import load_settings
from keel.state import AgentState, StateStore
from keel.stores import SQLiteDatabase, SQLStateBackend
from keel.testing import ScriptedModel


def _turn_error(agent: Agent, text: str) -> str:
    """The error class a turn ended with: raised (StoreError) or on the failed reply."""
    try:
        reply = agent.handle_sync("s1", "u1", text)
    except StoreError as exc:
        return type(exc).__name__
    assert reply.status == "failed" and reply.error, reply
    return reply.error.split(":")[0]


def _cap(db: SQLiteDatabase, spare_pages: int = 2) -> None:
    """Let this thread's connection grow the file by ``spare_pages`` pages only."""
    conn = db.connection()
    pages = conn.execute("PRAGMA page_count").fetchone()[0]
    conn.execute(f"PRAGMA max_page_count = {pages + spare_pages}")


def test_sqlite_full_is_a_storage_full_error_and_the_connection_stays_usable(
    tmp_path: Path,
) -> None:
    db = SQLiteDatabase(tmp_path / "keel.db")
    db.setup()
    with db.transaction() as conn:
        conn.execute("CREATE TABLE blobs (data BLOB)")
    _cap(db)  # PRAGMA max_page_count gives a real SQLITE_FULL without a full disk
    with pytest.raises(StorageFullError) as caught, db.transaction() as conn:
        conn.execute("INSERT INTO blobs VALUES (zeroblob(200000))")
    # SQLite rolled the transaction back itself; a second ROLLBACK used to fail with "cannot
    # rollback - no transaction is active" and replace SQLITE_FULL.
    cause = caught.value.__cause__
    assert isinstance(cause, sqlite3.OperationalError)
    assert cause.sqlite_errorcode == sqlite3.SQLITE_FULL
    assert "rollback" not in str(caught.value)
    with db.transaction() as conn:  # small writes still fit: nothing is left half-open
        conn.execute("INSERT INTO blobs VALUES (zeroblob(10))")
    with db.translated() as conn:
        assert conn.execute("SELECT count(*) FROM blobs").fetchone() == (1,)
    db.close()


def test_a_full_database_through_the_state_store(tmp_path: Path) -> None:
    db = SQLiteDatabase(tmp_path / "keel.db")
    store = StateStore(SQLStateBackend(db), AgentState)
    store.create("s1", AgentState())
    _cap(db, spare_pages=1)
    big = AgentState(data={"notes": "x" * 500_000})
    with pytest.raises(StorageFullError):
        store.checkpoint("s1", big, expected_version=1, reason="test")
    assert store.load("s1").version == 1  # nothing of the failed write is visible
    db.close()


@contextlib.contextmanager
def _tmpfs(mountpoint: Path, size: str) -> Iterator[Path]:
    mountpoint.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mountpoint)],
        capture_output=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True, check=False)


def _fill(directory: Path) -> Path:
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 65536)
    except OSError:
        pass
    finally:
        os.close(fd)
    return filler


def test_agent_on_a_full_disk_reports_storage_full_then_recovers(tmp_path: Path) -> None:
    """A real full file system (tmpfs; needs root, skipped elsewhere)."""
    with _tmpfs(tmp_path / "disk", "4m") as disk:
        model = ScriptedModel(lambda call: "ok " + "x" * 2000)
        settings = load_settings(data_dir=disk / "data")
        agent = Agent.embedded(model, system_prompt="hi", memory=False, settings=settings)
        try:
            assert agent.handle_sync("s1", "u1", "hello").status == "completed"
            filler = _fill(disk)
            for _ in range(2):  # every turn, not only the first
                assert _turn_error(agent, "again " + "y" * 20_000) == "StorageFullError"
            filler.unlink()
            assert agent.handle_sync("s1", "u1", "after").status == "completed"
            state = agent.session_state("s1")
            assert state is not None
            users = [m.content for m in state.messages if m.role == "user"]
            assert users == ["hello", "after"]  # the failed turns left nothing behind
            assert not any("again" in m.content for m in model.calls[-1].messages)
        finally:
            agent.close()


def _delete(path: Path) -> None:
    for suffix in ("", "-wal", "-shm"):
        with contextlib.suppress(FileNotFoundError):
            Path(f"{path}{suffix}").unlink()


def test_a_database_deleted_while_open_is_a_typed_error_and_no_new_file(tmp_path: Path) -> None:
    path = tmp_path / "keel.db"
    db = SQLiteDatabase(path)
    store = StateStore(SQLStateBackend(db), AgentState)
    store.create("s1", AgentState())
    _delete(path)
    with pytest.raises(DatabaseFileError):
        store.load("s1")  # a read would have gone on to the unlinked file
    with pytest.raises(DatabaseFileError):
        store.checkpoint("s1", AgentState(), expected_version=1, reason="test")
    errors: list[BaseException] = []

    def other_thread() -> None:  # a new connection would have created an empty database
        try:
            store.load("s1")
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join()
    assert len(errors) == 1 and isinstance(errors[0], DatabaseFileError)
    assert not path.exists()
    db.close()


def test_a_database_replaced_while_open_is_a_typed_error(tmp_path: Path) -> None:
    path = tmp_path / "keel.db"
    db = SQLiteDatabase(path)
    db.setup()
    _delete(path)
    other = SQLiteDatabase(path)
    other.setup()
    other.close()
    with pytest.raises(DatabaseFileError, match="replaced"), db.transaction():
        pass
    db.close()


def test_agent_with_its_database_deleted_mid_session(tmp_path: Path) -> None:
    settings = load_settings(data_dir=tmp_path / "data")
    agent = Agent.embedded(
        ScriptedModel(lambda call: "ok"), system_prompt="hi", memory=False, settings=settings
    )
    try:
        assert agent.handle_sync("s1", "u1", "hello").status == "completed"
        _delete(tmp_path / "data" / "keel.db")
        for _ in range(2):
            assert _turn_error(agent, "again") == "DatabaseFileError"
        assert not (tmp_path / "data" / "keel.db").exists()
    finally:
        agent.close()


@contextlib.contextmanager
def _read_only(path: Path) -> Iterator[None]:
    """Make the file read-only: a read-only bind mount as root (root ignores modes)."""
    if os.geteuid() != 0:
        path.chmod(0o444)
        try:
            yield
        finally:
            path.chmod(0o644)
        return
    bound = subprocess.run(
        ["mount", "--bind", str(path), str(path)], capture_output=True, check=False
    )
    if bound.returncode != 0:
        pytest.skip(f"cannot bind-mount here: {bound.stderr.decode().strip()}")
    try:
        remounted = subprocess.run(
            ["mount", "-o", "remount,bind,ro", str(path)], capture_output=True, check=False
        )
        if remounted.returncode != 0:
            pytest.skip(f"cannot remount read-only: {remounted.stderr.decode().strip()}")
        yield
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


def test_a_read_only_database_is_a_read_only_store_error(tmp_path: Path) -> None:
    path = tmp_path / "data" / "keel.db"
    settings = load_settings(data_dir=tmp_path / "data")
    first = Agent.embedded(
        ScriptedModel(lambda call: "ok"), system_prompt="hi", memory=False, settings=settings
    )
    assert first.handle_sync("s1", "u1", "hello").status == "completed"
    first.close()
    with _read_only(path):
        db = SQLiteDatabase(path)
        store = StateStore(SQLStateBackend(db), AgentState)
        loaded = store.load("default/s1")  # reading still works
        with pytest.raises(DatabaseReadOnlyError) as caught:
            store.checkpoint(
                "default/s1", loaded.state, expected_version=loaded.version, reason="t"
            )
        assert isinstance(caught.value.__cause__, sqlite3.OperationalError)
        db.close()
        agent = Agent.embedded(
            ScriptedModel(lambda call: "ok"), system_prompt="hi", memory=False, settings=settings
        )
        try:
            assert _turn_error(agent, "again") == "DatabaseReadOnlyError"
        finally:
            agent.close()


@pytest.mark.parametrize(
    ("error_name", "expected"),
    [
        ("DiskFull", StorageFullError),
        ("ReadOnlySqlTransaction", DatabaseReadOnlyError),
        # psycopg files serialization failures (SQLSTATE class 40) under OperationalError.
        ("SerializationFailure", BackendUnavailableError),
        ("OperationalError", BackendUnavailableError),
        ("UniqueViolation", StoreError),
    ],
)
def test_postgres_errors_are_translated_by_sqlstate(
    error_name: str, expected: type[StoreError]
) -> None:
    psycopg = pytest.importorskip("psycopg")
    from keel.stores import translate_postgres_error

    raised = getattr(psycopg.errors, error_name, None) or getattr(psycopg, error_name)
    error = translate_postgres_error(raised("boom"), "postgresql://u:secret@h/db?sslmode=off")
    assert type(error) is expected
    assert "h/db" in str(error) and "secret" not in str(error)


def test_keel_chat_with_its_database_deleted_is_one_error_line(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "KEEL_DATA_DIR": str(tmp_path / "data"),
        "KEEL_EMBEDDER": "hashing:64",
    }
    chat = subprocess.Popen(
        [sys.executable, "-m", "keel", "chat", "--model", "scripted:echo", "--no-memory"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert chat.stdin is not None and chat.stdout is not None
    try:
        chat.stdin.write("hello there\n")
        chat.stdin.flush()
        while "agent>" not in (line := chat.stdout.readline()):
            assert line, "keel chat ended before answering"
        _delete(tmp_path / "data" / "keel.db")
        out, err = chat.communicate("are you still there?\n", timeout=120)
    finally:
        if chat.poll() is None:
            chat.kill()
    assert chat.returncode == 1, (out, err)
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "deleted" in lines[0], err
    assert "Traceback" not in err
    assert not (tmp_path / "data" / "keel.db").exists()


def test_a_failed_read_snapshot_ends_cleanly_with_its_own_error(tmp_path: Path) -> None:
    db = SQLiteDatabase(tmp_path / "keel.db")
    db.setup()
    with pytest.raises(StoreError, match="no such table"), db.snapshot() as conn:
        conn.execute("SELECT * FROM missing")
    with pytest.raises(LookupError), db.snapshot():
        raise LookupError("the caller's own error, unchanged")
    assert not db.connection().in_transaction
    with db.transaction() as conn:  # the connection is free for the next writer
        conn.execute("CREATE TABLE t (x)")
    db.close()
