"""The masker's cache with a numbering (a user's vault): a text with nothing to mask is served
from the cache under any numbering, a text with values is always numbered by the numbering it
is given, never by a cached result of another numbering (or of none)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from keel.privacy import MasterKey, PIIMasker, Vault
from keel.stores import SQLiteDatabase
from keel.stores._sqlite_vault import SQLiteVaultStore


def test_a_cached_text_never_takes_another_numberings_placeholders() -> None:
    masker = PIIMasker()
    text = "write to ada@example.com"
    assert masker.mask_text(text) == "write to <EMAIL_1>"

    def vault_numbering(entity: str, value: str) -> str:
        return f"<{entity}_7>"

    assert masker.mask_text(text, numbering=vault_numbering) == "write to <EMAIL_7>"
    assert masker.mask_text(text, numbering=lambda e, v: f"<{e}_9>") == "write to <EMAIL_9>"
    assert masker.mask_text(text) == "write to <EMAIL_1>"


def test_a_text_with_nothing_to_mask_asks_no_numbering() -> None:
    masker = PIIMasker()
    asked: list[str] = []

    def numbering(entity: str, value: str) -> str:
        asked.append(value)
        return f"<{entity}_1>"

    history = "Noted: your address is <EMAIL_1>, thanks."
    for _ in range(3):
        assert masker.mask_text(history, numbering=numbering) == history
    assert masker.mask(history, numbering=numbering).placeholders == {}
    assert asked == []


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
