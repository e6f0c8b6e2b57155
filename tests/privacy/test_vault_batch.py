"""A text's values are placed in the user's vault at once: one look-up of the store for what
the view has not placed yet and one write (``VaultStore.add_values``) for what is new, through
``Agent`` as through ``UserVault.placeholders`` and ``PIIMasker.mask(batch_numbering=)``."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from keel.privacy import MasterKey, PIIMasker, StoredKey, UserVault, VaultStore
from keel.runtime import Agent
from keel.settings import load_settings
from keel.stores import Backends
from keel.testing import ScriptedModel
from keel.tools import tool

TENANT = "acme"
EMAIL, PHONE, CARD = "ada.lovelace@example.com", "+1 415 555 0132", "4111 1111 1111 1111"


class _Writes:
    """The vault store's value writes, counted on the real store (the calls go through)."""

    def __init__(self, store: VaultStore, monkeypatch: pytest.MonkeyPatch) -> None:
        self.batches: list[list[str]] = []
        self.single = 0
        self.lookups = 0
        add_values, add_value, numbers = store.add_values, store.add_value, store.numbers

        def counted_batch(
            tenant_id: str,
            user_id: str,
            values: Sequence[tuple[str, bytes, bytes]],
            *,
            key: StoredKey,
        ) -> list[int] | None:
            self.batches.append([entity for entity, _, _ in values])
            return add_values(tenant_id, user_id, values, key=key)

        def counted_single(*args: Any, **kwargs: Any) -> int | None:
            self.single += 1
            return add_value(*args, **kwargs)

        def counted_lookup(*args: Any) -> dict[bytes, tuple[str, int]]:
            self.lookups += 1
            return numbers(*args)

        monkeypatch.setattr(store, "add_values", counted_batch)
        monkeypatch.setattr(store, "add_value", counted_single)
        monkeypatch.setattr(store, "numbers", counted_lookup)


@pytest.fixture
def backends(tmp_path: Path) -> Iterator[Backends]:
    settings = load_settings(data_dir=tmp_path, embedder="hashing:64")
    opened = Backends.open(settings, memory=False, pii_key=MasterKey.generate())
    yield opened
    opened.close()


def _user(backends: Backends, user_id: str = "alice") -> UserVault:
    assert backends.vault is not None
    return backends.vault.user(TENANT, user_id)


async def test_a_turn_places_the_values_of_the_users_message_in_one_write(
    backends: Backends, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert backends.vault is not None
    writes = _Writes(backends.vault.store, monkeypatch)
    agent = Agent.on_backends(
        backends, ScriptedModel(lambda call: "Noted."), system_prompt="You help.", tenant_id=TENANT
    )
    try:
        message = f"mail {EMAIL}, call {PHONE}, card {CARD}; again: {EMAIL}"
        reply = await agent.handle("s-1", "alice", message)
        assert reply.status == "completed"
        # Three new values (the email twice), in the order the text gives them.
        assert writes.batches == [["EMAIL", "PHONE", "CREDIT_CARD"]]
        assert writes.single == 0
        placed = _user(backends).placeholders([("EMAIL", EMAIL), ("PHONE", PHONE)])
        assert placed == ["<EMAIL_1>", "<PHONE_1>"]
        assert len(writes.batches) == 1  # nothing new to store the second time
    finally:
        await agent.aclose()


def test_placeholders_are_those_placed_one_by_one_in_order(
    backends: Backends, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert backends.vault is not None
    one_by_one = [_user(backends, "bob").placeholder(e, v) for e, v in [("EMAIL", EMAIL)] * 2]
    assert one_by_one == ["<EMAIL_1>", "<EMAIL_1>"]
    writes = _Writes(backends.vault.store, monkeypatch)
    user = _user(backends)
    first = user.placeholders([("EMAIL", "a@example.com"), ("PHONE", PHONE)])
    batch = [("EMAIL", "b@example.com"), ("EMAIL", "a@example.com"), ("EMAIL", "b@example.com")]
    assert (first, user.placeholders(batch)) == (
        ["<EMAIL_1>", "<PHONE_1>"],
        ["<EMAIL_2>", "<EMAIL_1>", "<EMAIL_2>"],
    )
    # The second batch stored only its new value; values this view placed are not looked up
    # again.
    assert writes.batches == [["EMAIL", "PHONE"], ["EMAIL"]]
    assert writes.lookups == 2
    assert user.placeholders(batch[:2]) == ["<EMAIL_2>", "<EMAIL_1>"]
    assert writes.lookups == 2
    assert user.placeholders([]) == []
    again = _user(backends)  # a new view (another turn) reads the same numbers
    assert again.placeholders([("PHONE", PHONE), ("EMAIL", "b@example.com")]) == [
        "<PHONE_1>",
        "<EMAIL_2>",
    ]
    assert len(writes.batches) == 2


def test_a_batch_whose_user_is_forgotten_meanwhile_is_placed_under_a_new_key(
    backends: Backends, monkeypatch: pytest.MonkeyPatch
) -> None:
    vault = backends.vault
    assert vault is not None
    user = _user(backends)
    assert user.placeholders([("EMAIL", EMAIL)]) == ["<EMAIL_1>"]
    add_values = vault.store.add_values
    forgotten: list[int] = []

    def forget_first(
        tenant_id: str, user_id: str, values: Sequence[tuple[str, bytes, bytes]], *, key: StoredKey
    ) -> list[int] | None:
        if not forgotten:  # a forget lands between the look-up and the write
            forgotten.append(vault.forget(tenant_id, user_id))
        return add_values(tenant_id, user_id, values, key=key)

    monkeypatch.setattr(vault.store, "add_values", forget_first)
    placed = user.placeholders([("PHONE", PHONE), ("EMAIL", "new@example.com")])
    assert forgotten == [1]
    # Under the new key, numbers go on after the forgotten ones (never reused).
    assert placed == ["<PHONE_1>", "<EMAIL_2>"]
    assert _user(backends).values(placed) == {"<PHONE_1>": PHONE, "<EMAIL_2>": "new@example.com"}


def test_the_masker_hands_a_texts_findings_to_the_batch_numbering_once() -> None:
    calls: list[list[tuple[str, str]]] = []

    def batch(values: Sequence[tuple[str, str]]) -> list[str]:
        calls.append(list(values))
        return [f"<{entity}_{40 + index}>" for index, (entity, _) in enumerate(values)]

    def single(entity: str, value: str) -> str:
        raise AssertionError("the batch numbering is preferred")

    text = f"mail {EMAIL} or {EMAIL}, call {PHONE}"
    masked = PIIMasker().mask(text, numbering=single, batch_numbering=batch)
    assert calls == [[("EMAIL", EMAIL), ("PHONE", PHONE)]]
    assert masked.text == "mail <EMAIL_40> or <EMAIL_40>, call <PHONE_41>"
    assert masked.placeholders == {"<EMAIL_40>": "EMAIL", "<PHONE_41>": "PHONE"}
    assert masked.counts == {"EMAIL": 2, "PHONE": 1}
    # Without a finding the numbering is not called, and the per-value numbering still works.
    assert PIIMasker().mask_text("nothing here", batch_numbering=batch) == "nothing here"
    assert len(calls) == 1
    per_value = PIIMasker().mask_text(text, numbering=lambda entity, value: f"<{entity}_9>")
    assert per_value == "mail <EMAIL_9> or <EMAIL_9>, call <PHONE_9>"


async def test_a_turn_masks_each_text_holding_a_value_once(
    backends: Backends, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The log, the trace and the journal mask the same texts again: the turn's memo answers
    # them, so a text's values are looked up in the user's vault once a turn, not per use.
    placed: list[tuple[tuple[str, str], ...]] = []
    placeholders = UserVault.placeholders

    def counted(self: UserVault, found: Sequence[tuple[str, str]]) -> list[str]:
        placed.append(tuple(found))
        return placeholders(self, found)

    @tool(side_effect=True)
    def look_up(name: str) -> str:
        """Find a customer.

        Args:
            name: Their name.
        """
        return f"{name}: {EMAIL}, {PHONE}, card {CARD}"

    monkeypatch.setattr(UserVault, "placeholders", counted)
    model = ScriptedModel(
        [ScriptedModel.tool_call("look_up", json.dumps({"name": "Ada"})), f"Found: {EMAIL}."]
    )
    agent = Agent.on_backends(
        backends, model, system_prompt="You help.", tools=[look_up], tenant_id=TENANT
    )
    try:
        reply = await agent.handle("s-1", "alice", f"mail {EMAIL}, call {PHONE}")
        assert reply.status == "completed"
        assert placed, "the user's values were never placed"
        assert len(placed) == len(set(placed)), placed
    finally:
        await agent.aclose()
