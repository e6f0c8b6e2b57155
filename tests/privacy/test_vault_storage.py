"""The PII vault as the opener sets it up, on SQLite and on the real PostgreSQL: what is on disk
holds only ciphertext, a rotated-away key is refused, and ``forget`` leaves nothing of the user
that the master key and a copy of the database could recover."""

from __future__ import annotations

import shutil
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from keel.errors import PlaceholderError, VaultKeyError
from keel.privacy import MasterKey, PIIMasker, placeholders_in
from keel.privacy._vault import _owner
from keel.settings import Settings, load_settings
from keel.stores import Backends
from tests.privacy._samples import TOOL_PII, USER_PII, dump_sqlite, leaks, sentence

ALICE = ("acme", "alice")
BOB = ("acme", "bob")
_VAULT_TABLES = ("keel_pii_keys", "keel_pii_values", "keel_pii_key_checks")


@pytest.fixture(autouse=True)
def _hashing_embedder(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEEL_EMBEDDER", "hashing:64")


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def settings(request: pytest.FixtureRequest, tmp_path: Path) -> Settings:
    if request.param == "postgres":
        return load_settings(database=request.getfixturevalue("postgres_url"))
    return load_settings(data_dir=tmp_path)


def _open(settings: Settings, key: MasterKey) -> Backends:
    return Backends.open(settings, memory=False, pii_key=key)


def _mask(backends: Backends, owner: tuple[str, str], values: dict[str, str]) -> str:
    """The sentence carrying ``values``, masked with the owner's vault numbering."""
    assert backends.vault is not None
    user = backends.vault.user(*owner)
    masked = PIIMasker().mask_text(sentence(values), numbering=user.placeholder)
    assert len(placeholders_in(masked)) == len(values)
    return masked


def _mask_both(backends: Backends) -> dict[tuple[str, str], str]:
    """Alice's sentence (the user's PII) and Bob's (a tool's), each masked in their vault."""
    return {
        owner: _mask(backends, owner, pii) for owner, pii in ((ALICE, USER_PII), (BOB, TOOL_PII))
    }


def _resolves(
    backends: Backends, owner: tuple[str, str], masked: str, values: dict[str, str]
) -> None:
    assert backends.vault is not None
    assert backends.vault.user(*owner).resolve(masked) == sentence(values)


def _vault_rows(backends: Backends) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of the vault's tables, read from the database as it is."""
    with backends.sql.transaction() as conn:
        return {
            table: [tuple(row) for row in conn.execute(f"SELECT * FROM {table}").fetchall()]
            for table in _VAULT_TABLES
        }


def _on_disk(path: Path) -> bytes:
    wal = path.with_name(path.name + "-wal")
    return path.read_bytes() + (wal.read_bytes() if wal.exists() else b"")


def _raw_forms(values: dict[str, str]) -> Iterator[bytes]:
    for value in values.values():
        yield value.encode()
        yield value.replace(" ", "").encode()


def _columns_text(rows: dict[str, list[tuple[Any, ...]]]) -> dict[str, str]:
    """Each table's cells as text (bytes byte for byte), for :func:`leaks`."""
    return {
        table: "\n".join(
            " | ".join(
                bytes(cell).decode("latin-1") if isinstance(cell, bytes | memoryview) else str(cell)
                for cell in row
            )
            for row in table_rows
        )
        for table, table_rows in rows.items()
    }


def _recover(master: MasterKey, rows: dict[str, list[tuple[Any, ...]]]) -> set[str]:
    """Every value the master key opens from these rows, trying every wrapped key under every
    owner the rows name, and every sealed value under every data key so found."""
    keys = rows["keel_pii_keys"]
    values = rows["keel_pii_values"]
    owners = {(row[0], row[1]) for row in (*keys, *values)}
    data_keys: set[bytes] = set()
    for row in keys:
        for owner in owners:
            try:
                data_keys.add(master.unwrap(bytes(row[2]), _owner(*owner)))
            except VaultKeyError:
                continue
    recovered: set[str] = set()
    for _, _, _, _, token, sealed, _ in values:
        if token is None or sealed is None:
            continue
        sealed = bytes(sealed)
        for data_key in data_keys:
            for owner in owners:
                aad = _owner(*owner) + b"\x00" + bytes(token)
                try:
                    plain = AESGCM(data_key).decrypt(sealed[:12], sealed[12:], aad)
                except InvalidTag:
                    continue
                recovered.add(plain.decode())
    return recovered


def test_the_vault_holds_only_ciphertext(settings: Settings) -> None:
    key = MasterKey.generate()
    with _open(settings, key) as backends:
        masked = _mask_both(backends)
        _resolves(backends, ALICE, masked[ALICE], USER_PII)
        rows = _vault_rows(backends)
        assert len(rows["keel_pii_values"]) == len(USER_PII) + len(TOOL_PII)
        assert leaks(_columns_text(rows), USER_PII, TOOL_PII) == []
        # What the rows hold opens with the master key: they are the values, sealed.
        assert _recover(key, rows) == {*USER_PII.values(), *TOOL_PII.values()}
        path = backends.database.path
        if path is not None:
            raw = _on_disk(Path(path))
            assert [form for form in _raw_forms({**USER_PII, **TOOL_PII}) if form in raw] == []
    if path is not None:
        assert leaks(dump_sqlite(Path(path)), USER_PII, TOOL_PII) == []


def test_after_rotation_the_old_key_is_refused_and_the_new_one_opens_everything(
    settings: Settings,
) -> None:
    old, new = MasterKey.generate(), MasterKey.generate()
    with _open(settings, old) as backends:
        masked = _mask_both(backends)
        assert backends.vault is not None
        assert backends.vault.rotate(new) == 2
        # This process goes on with the new key.
        _resolves(backends, BOB, masked[BOB], TOOL_PII)
    with pytest.raises(VaultKeyError, match="not this vault's"):
        _open(settings, old)
    with _open(settings, new) as backends:
        _resolves(backends, ALICE, masked[ALICE], USER_PII)
        _resolves(backends, BOB, masked[BOB], TOOL_PII)
        rows = _vault_rows(backends)
        assert {row[3] for row in rows["keel_pii_keys"]} == {new.key_id}
        assert {row[0] for row in rows["keel_pii_key_checks"]} == {new.key_id}


def test_forget_leaves_nothing_of_the_user_for_the_master_key(settings: Settings) -> None:
    key = MasterKey.generate()
    with _open(settings, key) as backends:
        masked = _mask_both(backends)
        assert backends.vault is not None
        assert backends.vault.forget(*ALICE) == len(USER_PII)
        with pytest.raises(PlaceholderError, match="erased"):
            backends.vault.user(*ALICE).resolve(masked[ALICE])
        rows = _vault_rows(backends)
        # Either half of the erasure alone would defeat the master key; both are done.
        assert [row for row in rows["keel_pii_keys"] if (row[0], row[1]) == ALICE] == []
        alices = [row for row in rows["keel_pii_values"] if (row[0], row[1]) == ALICE]
        assert len(alices) == len(USER_PII)
        assert {(row[4], row[5]) for row in alices} == {(None, None)}
        assert _recover(key, rows) == set(TOOL_PII.values())
        _resolves(backends, BOB, masked[BOB], TOOL_PII)
        # A new value of Alice's takes a new number: her old placeholders stay dead.
        again = _mask(backends, ALICE, USER_PII)
        assert set(placeholders_in(again)).isdisjoint(placeholders_in(masked[ALICE]))


def test_a_copy_of_the_file_taken_after_forget_gives_nothing_of_the_user(tmp_path: Path) -> None:
    settings = load_settings(data_dir=tmp_path / "live")
    key = MasterKey.generate()
    with _open(settings, key) as backends:
        masked = _mask_both(backends)
        assert backends.vault is not None
        before = _vault_rows(backends)
        alices = [
            bytes(cell)
            for row in before["keel_pii_keys"] + before["keel_pii_values"]
            if (row[0], row[1]) == ALICE
            for cell in row
            if isinstance(cell, bytes)
        ]
        backends.vault.forget(*ALICE)
        # The copy is taken while the database is open, as a backup or a thief would take it.
        live = Path(str(backends.database.path))
        copy = tmp_path / "copy" / "keel.db"
        copy.parent.mkdir()
        for suffix in ("", "-wal"):
            source = live.with_name(live.name + suffix)
            if source.exists():
                shutil.copyfile(source, copy.with_name(copy.name + suffix))
    raw = _on_disk(copy)
    assert alices and [secret for secret in alices if secret in raw] == []
    conn = sqlite3.connect(copy)
    try:
        rows = {
            table: [tuple(row) for row in conn.execute(f"SELECT * FROM {table}")]
            for table in _VAULT_TABLES
        }
    finally:
        conn.close()
    assert _recover(key, rows) == set(TOOL_PII.values())
    with _open(load_settings(database=f"sqlite:///{copy}"), key) as restored:
        _resolves(restored, BOB, masked[BOB], TOOL_PII)
        assert restored.vault is not None
        assert restored.vault.user(*ALICE).reveal(masked[ALICE]) == masked[ALICE]
