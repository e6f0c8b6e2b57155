"""Erasure on PostgreSQL, read from the write-ahead log itself: after ``forget`` and a
CHECKPOINT, ``pg_wal`` still holds the user's data key wrapped by the master key (and their
sealed values), so ``forget`` alone is not final; ``keel privacy forget --finalize`` (forget, then
a rotation to a new master key, the old one destroyed) leaves nothing there the new key opens."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import psycopg
import pytest

from keel.errors import VaultKeyError
from keel.privacy import MasterKey
from keel.privacy._vault import _owner
from keel.settings import load_settings
from keel.stores import Backends
from tests.cli import keel_process

pytestmark = pytest.mark.postgres

_WRAPPED_BYTES = 1 + 12 + 32 + 16
"""A wrapped data key: the format byte, the nonce, the key and the GCM tag."""
_WRAPPED_IN_A_ROW = bytes([(_WRAPPED_BYTES + 1) << 1 | 1, 1])
"""How PostgreSQL lays such a bytea in a row: its one-byte length header, then format byte 1."""


def _wal(url: str) -> list[bytes]:
    """The segments of ``pg_wal``, read once the log is written out. A segment switch writes
    it and keeps every segment (a CHECKPOINT may remove the one that held what the test looks
    for, once the log has crossed into the next)."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SELECT pg_switch_wal()")
        row = conn.execute("SHOW data_directory").fetchone()
    assert row is not None
    return [
        segment.read_bytes()
        for segment in sorted((Path(row[0]) / "pg_wal").iterdir())
        if segment.is_file() and len(segment.name) == 24
    ]


def _wrapped_keys_in(wal: list[bytes]) -> list[bytes]:
    """Every byte run in ``wal`` laid out as a wrapped data key in an inserted row."""
    found: list[bytes] = []
    for data in wal:
        at = data.find(_WRAPPED_IN_A_ROW)
        while at != -1:
            found.append(data[at + 1 : at + 1 + _WRAPPED_BYTES])
            at = data.find(_WRAPPED_IN_A_ROW, at + 1)
    return found


def _opened(key: MasterKey, candidates: list[bytes], user: str) -> set[bytes]:
    """The data keys of ``acme/user`` that ``key`` opens among ``candidates``."""
    opened: set[bytes] = set()
    for wrapped in candidates:
        try:
            opened.add(key.unwrap(wrapped, _owner("acme", user)))
        except VaultKeyError:
            continue
    return opened


def _privacy(url: str, key: str, *args: str, **env: str) -> dict[str, object]:
    result: subprocess.CompletedProcess[str] = keel_process(
        "privacy", *args, "--database", url, "--json", env={"KEEL_PII_KEY": key, **env}
    )
    assert result.returncode == 0, result.stderr
    payload: dict[str, object] = json.loads(result.stdout.strip().splitlines()[-1])
    return payload


def test_forget_is_final_in_the_wal_only_once_the_master_key_is_rotated_away(
    postgres_url: str,
) -> None:
    old_text, new_text = MasterKey.new_key_text(), MasterKey.new_key_text()
    old = MasterKey.from_text(old_text)
    settings = load_settings(database=postgres_url)
    with Backends.open(settings, memory=False, pii_key=old) as backends:
        assert backends.vault is not None
        alice = backends.vault.user("acme", "alice")
        alice.placeholders([("EMAIL", f"alice.{n}@example.org") for n in range(40)])
        bob = backends.vault.user("acme", "bob")
        bob_placeholder = bob.placeholder("EMAIL", "bob@example.net")
        stored = backends.vault.store.data_key("acme", "alice")
        assert stored is not None
        alices_key = old.unwrap(stored.wrapped, _owner("acme", "alice"))

    forgot = _privacy(postgres_url, old_text, "forget", "--tenant", "acme", "--user", "alice")
    assert forgot["erased"] == 40
    assert "not yet in copies of the database" in str(forgot["final"])
    # The rows are gone, but the log keeps the data key, which the master key still opens.
    assert _opened(old, _wrapped_keys_in(_wal(postgres_url)), "alice") == {alices_key}

    finalized = _privacy(
        postgres_url,
        old_text,
        "forget",
        "--tenant",
        "acme",
        "--user",
        "alice",
        "--finalize",
        "--new-key-env",
        "NEW_PII_KEY",
        NEW_PII_KEY=new_text,
    )
    assert finalized["rewrapped"] == 1 and finalized["key_id"] != finalized["old_key_id"]
    # The old key destroyed: this process no longer holds it, and the vault refuses it.
    del old
    with pytest.raises(VaultKeyError, match="not this vault's"):
        Backends.open(settings, memory=False, pii_key=MasterKey.from_text(old_text))
    old_text = ""
    new = MasterKey.from_text(new_text)
    wal = _wal(postgres_url)
    assert _opened(new, _wrapped_keys_in(wal), "alice") == set()
    with Backends.open(settings, memory=False, pii_key=new) as backends:
        assert backends.vault is not None
        assert backends.vault.user("acme", "bob").resolve(bob_placeholder) == "bob@example.net"
        rewrapped = backends.vault.store.data_key("acme", "bob")
    # The log does hold what the new key wrapped (Bob's data key, logged as an update), and the
    # new key opens that: the scan sees. PostgreSQL logs an update without the bytes its old
    # and new rows share at their start and at their end, and a random wrapped key shares a
    # byte with the old one there 1 time in 256 at each end: its middle is always logged.
    assert rewrapped is not None and rewrapped.key_id == new.key_id
    assert len(rewrapped.wrapped) > 24
    assert any(rewrapped.wrapped[8:-8] in data for data in wal)
