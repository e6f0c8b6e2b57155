"""``keel privacy``: a new key, forget, rotate-key and status, run as a user runs them."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from keel.errors import PlaceholderError
from keel.privacy import MasterKey
from keel.settings import default_pii_key_file, load_settings
from keel.stores import Backends
from tests.cli import keel_process

ALICE = {"EMAIL": "alice.w9z@example.org", "PHONE": "+1 415 555 0143"}
BOB = {"EMAIL": "bob.k2m@example.net"}


@pytest.fixture(autouse=True)
def _hashing_embedder(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEEL_EMBEDDER", "hashing:64")


def _keel(*args: str, key: str | None, **env: str) -> subprocess.CompletedProcess[str]:
    return keel_process("privacy", *args, env={**({"KEEL_PII_KEY": key} if key else {}), **env})


def _json(result: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert result.returncode == 0, result.stderr
    payload: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return payload


def _one_error_line(result: subprocess.CompletedProcess[str], says: str) -> None:
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert says in lines[0], lines[0]


def _store(key: str) -> dict[str, dict[str, str]]:
    """Alice's and Bob's values in the default database's vault: placeholder -> value."""
    placed: dict[str, dict[str, str]] = {}
    with Backends.open(load_settings(), memory=False, pii_key=MasterKey.from_text(key)) as stores:
        assert stores.vault is not None
        for user, values in (("alice", ALICE), ("bob", BOB)):
            view = stores.vault.user("acme", user)
            placed[user] = {view.placeholder(kind, value): value for kind, value in values.items()}
    return placed


def _resolved(key: str, user: str, placeholders: dict[str, str]) -> dict[str, str]:
    with Backends.open(load_settings(), memory=False, pii_key=MasterKey.from_text(key)) as stores:
        assert stores.vault is not None
        return stores.vault.user("acme", user).values(placeholders)


def test_new_key_prints_a_fresh_usable_key() -> None:
    keys = [_keel("new-key", key=None) for _ in range(2)]
    texts = [result.stdout.strip() for result in keys]
    assert all(result.returncode == 0 for result in keys)
    assert texts[0] != texts[1]
    assert MasterKey.from_text(texts[0]).key_id != MasterKey.from_text(texts[1]).key_id


def test_new_key_writes_a_private_file_and_never_overwrites_it(tmp_path: Path) -> None:
    path = tmp_path / "pii.key"
    made = _keel("new-key", "--file", str(path), key=None)
    assert made.returncode == 0, made.stderr
    written = path.read_text()
    assert written.strip() not in made.stdout
    assert path.stat().st_mode & 0o777 == 0o600
    MasterKey.from_file(path)
    _one_error_line(_keel("new-key", "--file", str(path), key=None), "never overwritten")
    assert path.read_text() == written


def test_status_forget_and_status_again() -> None:
    key = MasterKey.new_key_text()
    placed = _store(key)
    assert _json(_keel("status", "--json", key=key)) == {
        "vault": "on",
        "key_id": MasterKey.from_text(key).key_id,
        "users": 2,
        "values": 3,
        "erased": 0,
    }
    shown = _keel("status", key=key)
    assert "2 users, 3 values sealed" in shown.stdout
    forgot = _keel("forget", "--tenant", "acme", "--user", "alice", key=key)
    assert forgot.returncode == 0, forgot.stderr
    assert forgot.stdout.splitlines()[0] == "erased 2 values of acme/alice"
    assert "until it is rotated away and destroyed" in forgot.stdout
    assert _json(_keel("status", "--json", key=key))["erased"] == 2
    with pytest.raises(PlaceholderError, match="erased"):
        _resolved(key, "alice", placed["alice"])
    assert _resolved(key, "bob", placed["bob"]) == placed["bob"]
    again = _json(_keel("forget", "--tenant", "acme", "--user", "alice", "--json", key=key))
    assert again.pop("final").startswith("not yet in copies of the database")
    assert again == {"tenant": "acme", "user": "alice", "erased": 0}
    for result in (shown, forgot):
        assert not [value for value in (*ALICE.values(), *BOB.values()) if value in result.stdout]


def test_status_without_a_key_on_sqlite_is_keels_own_key_and_off_only_when_asked() -> None:
    status = _json(_keel("status", "--json", key=None))
    key = MasterKey.from_file(default_pii_key_file())
    assert status == {"vault": "on", "key_id": key.key_id, "users": 0, "values": 0, "erased": 0}
    assert _json(_keel("status", "--json", key=None, KEEL_PII_VAULT="off")) == {
        "vault": "off",
        "reason": "KEEL_PII_VAULT=off",
        "users": 0,
        "values": 0,
        "erased": 0,
    }


def test_rotate_key_rewraps_and_the_old_key_is_refused_after(tmp_path: Path) -> None:
    old, new = MasterKey.new_key_text(), MasterKey.new_key_text()
    placed = _store(old)
    rotated = _json(
        _keel("rotate-key", "--new-key-env", "NEW_PII_KEY", "--json", key=old, NEW_PII_KEY=new)
    )
    assert rotated == {
        "rewrapped": 2,
        "old_key_id": MasterKey.from_text(old).key_id,
        "key_id": MasterKey.from_text(new).key_id,
    }
    _one_error_line(_keel("status", key=old), "is not this vault's")
    assert _json(_keel("status", "--json", key=new))["key_id"] == MasterKey.from_text(new).key_id
    for user in ("alice", "bob"):
        assert _resolved(new, user, placed[user]) == placed[user]
    # Back again, the new key given as a file this time.
    key_file = tmp_path / "old.key"
    key_file.write_text(old)
    key_file.chmod(0o600)
    back = _keel("rotate-key", "--new-key-file", str(key_file), key=new)
    assert back.returncode == 0, back.stderr
    assert back.stdout.startswith("re-wrapped 2 data keys under key ")
    assert _resolved(old, "alice", placed["alice"]) == placed["alice"]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("forget", "--tenant", "acme", "--user", "alice"), "no PII master key"),
        (("rotate-key", "--new-key-env", "NEW_PII_KEY"), "no PII master key"),
        (("forget", "--tenant", "", "--user", "alice"), "must not be empty"),
        (("rotate-key",), "one of --new-key-file or --new-key-env"),
        (("rotate-key", "--new-key-env", "NEW_PII_KEY", "--new-key-file", "k"), "one of"),
        (("rotate-key", "--new-key-env", "UNSET_PII_KEY"), "UNSET_PII_KEY holds no key"),
        (("rotate-key", "--new-key-env", "BAD_PII_KEY"), "BAD_PII_KEY is not a 32-byte key"),
        (("rotate-key", "--new-key-file", "/no/such.key"), "cannot read the PII key file"),
    ],
)
def test_a_command_that_cannot_run_is_one_error_line(args: tuple[str, ...], says: str) -> None:
    key = MasterKey.new_key_text() if args[0] == "rotate-key" and "no PII" not in says else None
    env = {"NEW_PII_KEY": MasterKey.new_key_text(), "BAD_PII_KEY": "nope"}
    if args[0] == "forget" and "no PII" in says:
        env["KEEL_PII_VAULT"] = "off"  # else the embedded default's own key opens the vault
    _one_error_line(_keel(*args, key=key, **env), says)


def test_a_wrong_key_is_one_error_line_and_changes_nothing() -> None:
    key = MasterKey.new_key_text()
    placed = _store(key)
    wrong = MasterKey.new_key_text()
    _one_error_line(
        _keel("forget", "--tenant", "acme", "--user", "alice", key=wrong), "is not this vault's"
    )
    _one_error_line(_keel("status", key="not-a-key"), "KEEL_PII_KEY is not a 32-byte key")
    assert _resolved(key, "alice", placed["alice"]) == placed["alice"]


def test_a_key_file_that_is_binary_or_open_to_others_is_one_error_line_without_key_bytes(
    tmp_path: Path,
) -> None:
    binary = tmp_path / "binary.key"
    raw = bytes([0xE9, 0x41, 0xFF]) + bytes(range(0x80, 0x9D))
    binary.write_bytes(raw)
    binary.chmod(0o600)
    result = _keel("status", key=None, KEEL_PII_KEY_FILE=str(binary))
    _one_error_line(result, "is not text")
    shown = [f"0x{byte:02x}" for byte in raw] + [f"\\x{byte:02x}" for byte in raw]
    assert [spelling for spelling in shown if spelling in result.stderr] == []
    shared = tmp_path / "shared.key"
    text = MasterKey.new_key_text()
    shared.write_text(text)
    shared.chmod(0o644)
    result = _keel("status", key=None, KEEL_PII_KEY_FILE=str(shared))
    _one_error_line(result, f"chmod 600 {shared}")
    assert text not in result.stderr
