"""UserVault.reveal: the user's own placeholders shown as their values (read in one go), any
other placeholder left as written."""

from __future__ import annotations

import tempfile
from pathlib import Path

from keel.privacy import MasterKey, Vault
from keel.stores import SQLiteDatabase
from keel.stores._sqlite_vault import SQLiteVaultStore


def test_reveal_shows_the_users_values_and_leaves_any_other_placeholder() -> None:
    with tempfile.TemporaryDirectory() as directory:
        database = SQLiteDatabase(Path(directory) / "keel.db")
        try:
            vault = Vault(SQLiteVaultStore(database), MasterKey.generate())
            ada = vault.user("acme", "ada")
            email, phone = ada.placeholder("EMAIL", "a@x.io"), ada.placeholder("PHONE", "+1 5")
            text = f"{email} / {phone} / <EMAIL_9>"
            assert ada.reveal(f"{email} / {phone}") == "a@x.io / +1 5"
            assert ada.reveal(text) == "a@x.io / +1 5 / <EMAIL_9>"
            assert vault.user("acme", "bob").reveal(text) == text
        finally:
            database.close()
