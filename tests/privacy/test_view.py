"""The privacy view: one user's masking and revealing for one unit of work. Its async mask
numbers as its blocking one does, and places a text's values in the vault off the event loop
(a text without values never reaches the store); without a vault it numbers per text, or
across its texts with ``per_call``; reads reveal the user's own placeholders only."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from keel.privacy import MasterKey, PIIMasker, Vault, privacy_view
from keel.stores import SQLiteDatabase
from tests.privacy._spy import SpyVaultStore

MASKER = PIIMasker()


@pytest.fixture
def vault(tmp_path: Path) -> Iterator[Vault]:
    with SQLiteDatabase(tmp_path / "vault.db") as db:
        yield Vault(SpyVaultStore(db), MasterKey.generate())


async def test_amask_numbers_as_mask_does_and_writes_off_the_loop(vault: Vault) -> None:
    store = vault.store
    assert isinstance(store, SpyVaultStore)
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


async def test_a_turn_places_the_users_and_the_models_values_off_the_event_loop(
    tmp_path: Path,
) -> None:
    """The user's message and the model's answer, each with a new value: placed in the vault
    by the turn's view off the loop (``amask``), then read back as themselves."""
    from keel.runtime import Agent
    from keel.testing import ScriptedModel

    with SQLiteDatabase(tmp_path / "vault.db") as db:
        store = SpyVaultStore(db)
        agent = Agent.open(
            f"sqlite:///{tmp_path / 'keel.db'}",
            system_prompt="You take notes.",
            model=ScriptedModel(["Noted; your backup is bob@backup.example."]),
            memory=False,
            vault=Vault(store, MasterKey.generate()),
        )
        try:
            reply = await agent.run("My email is ada@example.com", session="s", user="u")
        finally:
            await agent.aclose()
    assert reply.text == "Noted; your backup is bob@backup.example.", reply.text
    assert store.writes_on_loop, "nothing was placed in the vault"
    assert not any(store.writes_on_loop), (
        f"the vault was written on the event loop: {store.writes_on_loop}"
    )


async def test_a_side_effecting_tools_new_value_is_journalled_off_the_event_loop(
    tmp_path: Path,
) -> None:
    """A side-effecting tool returns a value the turn has not seen (a new phone number): the
    journal keeps its result masked, the value placed in the vault off the loop (the executor
    masks through the turn's async view), and the user reads it back as itself."""
    import json

    from keel.runtime import Agent
    from keel.testing import ScriptedCall, ScriptedModel
    from keel.tools import tool

    @tool(side_effect=True, idempotent=False)
    def open_ticket(subject: str) -> str:
        """Open a support ticket.

        Args:
            subject: What it is about.
        """
        return f"ticket T-1 opened for {subject}; the agent will call +1 415 555 2671"

    def model(call: ScriptedCall) -> object:
        if call.messages[-1].role == "user":
            return ScriptedModel.tool_call("open_ticket", json.dumps({"subject": "refund"}))
        return f"Done: {call.messages[-1].content}"

    with SQLiteDatabase(tmp_path / "vault.db") as db:
        store = SpyVaultStore(db)
        agent = Agent.open(
            f"sqlite:///{tmp_path / 'keel.db'}",
            system_prompt="You open tickets.",
            model=ScriptedModel(model),
            tools=[open_ticket],
            memory=False,
            vault=Vault(store, MasterKey.generate()),
        )
        try:
            reply = await agent.run("Please open a refund ticket", session="s", user="u")
        finally:
            await agent.aclose()
    assert "+1 415 555 2671" in reply.text, reply.text
    assert store.writes_on_loop, "nothing was placed in the vault"
    assert not any(store.writes_on_loop), (
        f"the vault was written on the event loop: {store.writes_on_loop}"
    )
