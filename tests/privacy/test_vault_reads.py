"""How often a user's view of the vault reads the store: a text's placeholders are read in one
call, whatever their number (a spy over the real SQLite store counts the reads)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from keel.errors import PlaceholderError
from keel.privacy import MasterKey, PIIMasker, Vault, placeholders_in
from keel.stores import SQLiteDatabase
from tests.privacy._samples import USER_PII, sentence
from tests.privacy._spy import SpyVaultStore


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SpyVaultStore]:
    with SQLiteDatabase(tmp_path / "vault.db") as db:
        yield SpyVaultStore(db)


def test_reveal_reads_all_of_a_texts_placeholders_in_one_call(store: SpyVaultStore) -> None:
    vault = Vault(store, MasterKey.generate())
    vault.check()
    alice = vault.user("acme", "alice")
    text = (
        f"write to {USER_PII['EMAIL']}, charge card {USER_PII['CREDIT_CARD']}, use the key "
        f"{USER_PII['API_KEY']}, wire to {USER_PII['IBAN']}, call {USER_PII['PHONE']}"
    )
    masked = PIIMasker().mask_text(text, numbering=alice.placeholder)
    assert len(placeholders_in(masked)) == 5
    # Five of the user's placeholders and one nobody has: the unknown one stays as written.
    masked_with_unknown = masked + " and <EMAIL_9>"
    before = store.sealed_reads
    revealed = vault.user("acme", "alice").reveal(masked_with_unknown)
    assert store.sealed_reads - before == 1
    assert revealed == text + " and <EMAIL_9>"


def test_values_reads_once_and_names_the_placeholder_that_fails(store: SpyVaultStore) -> None:
    vault = Vault(store, MasterKey.generate())
    vault.check()
    alice = vault.user("acme", "alice")
    masked = PIIMasker().mask_text(sentence(USER_PII), numbering=alice.placeholder)
    before = store.sealed_reads
    with pytest.raises(PlaceholderError, match="<PHONE_7>"):
        vault.user("acme", "alice").values(["<EMAIL_1>", "<PHONE_7>", "<IBAN_1>"])
    assert store.sealed_reads - before == 1
    assert "<EMAIL_1>" in masked
