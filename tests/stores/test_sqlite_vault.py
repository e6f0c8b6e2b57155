"""The SQLite vault store leaves no erased byte in the database file or its write-ahead log."""

from __future__ import annotations

import secrets
from pathlib import Path

from keel.privacy import MasterKey, StoredKey, Vault
from keel.stores import SQLiteDatabase, SQLiteVaultStore


def _on_disk(path: Path) -> bytes:
    """The database file's bytes and its write-ahead log's, as a copy of them would hold."""
    wal = path.with_name(path.name + "-wal")
    return path.read_bytes() + (wal.read_bytes() if wal.exists() else b"")


def _fill(store: SQLiteVaultStore, tenant: str, user: str, count: int) -> list[bytes]:
    """Store ``count`` values for the user; every secret byte string written for them."""
    key = StoredKey(secrets.token_bytes(60), "k1")
    store.add_key_check(StoredKey(b"check", "k1"))
    store.add_data_key(tenant, user, key)
    written = [key.wrapped]
    for _ in range(count):
        token, sealed = secrets.token_bytes(32), secrets.token_bytes(48)
        store.add_value(tenant, user, "EMAIL", token, sealed, key=key)
        written += [token, sealed]
    return written


def test_forget_leaves_no_erased_byte_in_the_file_or_the_log(tmp_path: Path) -> None:
    path = tmp_path / "keel.db"
    with SQLiteDatabase(path) as db:
        store = SQLiteVaultStore(db)
        forgotten = _fill(store, "acme", "alice", 40)
        kept = _fill(store, "acme", "bob", 40)
        before = _on_disk(path)
        # Meaningful only if the bytes were on disk to begin with.
        assert all(secret in before for secret in forgotten)
        assert store.forget("acme", "alice") == 40
        after = _on_disk(path)
        lingering = [secret for secret in forgotten if secret in after]
        assert lingering == []
        # The other user's rows are untouched (the WAL was checkpointed into the file).
        assert all(secret in after for secret in kept)


def test_a_rotation_leaves_no_key_wrapped_by_the_old_master_key(tmp_path: Path) -> None:
    path = tmp_path / "keel.db"
    with SQLiteDatabase(path) as db:
        vault = Vault(SQLiteVaultStore(db), MasterKey.generate())
        vault.check()
        for user in ("alice", "bob", "carol"):
            vault.user("acme", user).placeholder("EMAIL", f"{user}@example.com")
        old_wrapped = [key.wrapped for _, _, key in vault.store.data_keys()]
        [old_check] = vault.store.key_checks()
        assert all(wrapped in _on_disk(path) for wrapped in old_wrapped)
        assert vault.rotate(MasterKey.generate()) == 3
        after = _on_disk(path)
        assert [wrapped for wrapped in (*old_wrapped, old_check.wrapped) if wrapped in after] == []
