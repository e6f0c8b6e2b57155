"""The privacy view: one user's masking and revealing for one unit of work. Its async mask
numbers as its blocking one does, and places a text's values in the vault off the event loop
(a text without values never reaches the store); without a vault it numbers per text, or
across its texts with ``per_call``; reads reveal the user's own placeholders only."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from keel.privacy import MasterKey, PIIMasker, StoredKey, Vault, privacy_view
from keel.stores import SQLiteDatabase
from tests.privacy._spy import SpyVaultStore, _on_event_loop

MASKER = PIIMasker()


class WriteSpy(SpyVaultStore):
    """The spy store, also recording where each look-up of numbers and write of values ran."""

    def __init__(self, db: SQLiteDatabase) -> None:
        super().__init__(db)
        self.writes_on_loop: list[bool] = []

    def numbers(
        self, tenant_id: str, user_id: str, tokens: Sequence[bytes]
    ) -> dict[bytes, tuple[str, int]]:
        self.writes_on_loop.append(_on_event_loop())
        return super().numbers(tenant_id, user_id, tokens)

    def add_values(
        self,
        tenant_id: str,
        user_id: str,
        values: Sequence[tuple[str, bytes, bytes]],
        *,
        key: StoredKey,
    ) -> list[int] | None:
        self.writes_on_loop.append(_on_event_loop())
        return super().add_values(tenant_id, user_id, values, key=key)


@pytest.fixture
def vault(tmp_path: Path) -> Iterator[Vault]:
    with SQLiteDatabase(tmp_path / "vault.db") as db:
        yield Vault(WriteSpy(db), MasterKey.generate())


async def test_amask_numbers_as_mask_does_and_writes_off_the_loop(vault: Vault) -> None:
    store = vault.store
    assert isinstance(store, WriteSpy)
    first = privacy_view(MASKER, "acme", "ada", vault)
    assert first.mask("mail ada@example.com") == "mail <EMAIL_1>"
    store.writes_on_loop.clear()
    turn = privacy_view(MASKER, "acme", "ada", vault)
    text = "new: ada@new.example, old: ada@example.com, card 4111 1111 1111 1111"
    masked = await turn.amask(text)
    assert masked == "new: <EMAIL_2>, old: <EMAIL_1>, card <CREDIT_CARD_1>"
    assert store.writes_on_loop and not any(store.writes_on_loop), store.writes_on_loop
    assert turn.reveal(masked) == text
    # Masked again (its log, its trace): the view's memo, no store at all.
    store.writes_on_loop.clear()
    assert await turn.amask(text) == masked and turn.mask(text) == masked
    assert await turn.amask("nothing to hide here") == "nothing to hide here"
    assert store.writes_on_loop == []


async def test_amask_of_a_text_holding_the_slot_mark_is_still_exact(vault: Vault) -> None:
    text = "odd \ue0000\ue000 text, mail bob@example.com"
    masked = await privacy_view(MASKER, "acme", "bob", vault).amask(text)
    assert masked == "odd \ue0000\ue000 text, mail <EMAIL_1>"


def test_without_a_vault_numbering_is_per_text_or_per_call() -> None:
    per_text = privacy_view(MASKER, "acme", "ada")
    assert per_text.mask("a@x.example") == per_text.mask("b@x.example") == "<EMAIL_1>"
    assert not per_text.reveals and per_text.reveal("<EMAIL_1>") == "<EMAIL_1>"
    per_call = privacy_view(MASKER, "acme", "ada", per_call=True)
    assert [per_call.mask("a@x.example"), per_call.mask("b@x.example")] == [
        "<EMAIL_1>",
        "<EMAIL_2>",
    ]


async def test_a_payload_reveals_the_users_own_placeholders_only(vault: Vault) -> None:
    ada = privacy_view(MASKER, "acme", "ada", vault)
    stored = ada.mask("mail ada@example.com")
    payload = {"items": [stored, "<EMAIL_7>"], "n": 1}
    assert await ada.revealed(payload) == {"items": ["mail ada@example.com", "<EMAIL_7>"], "n": 1}
    bob = privacy_view(MASKER, "acme", "bob", vault)
    assert await bob.revealed(payload) == payload
    assert bob.reveal_value({"to": stored}) == {"to": stored}
