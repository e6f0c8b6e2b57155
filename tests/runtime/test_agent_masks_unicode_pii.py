"""Issue 44, defect 12, through ``Agent``: a user message holding an IDN address with Unicode
letters, an address with a Cyrillic look-alike letter, a card in fullwidth digits and a bare
ten-digit phone number. The model sees placeholders only; the vault sealed each value whole and
``forget`` erases all four; no row of any table nor any byte of the SQLite file or its
write-ahead log holds a raw value (in its own form or in ASCII)."""

from __future__ import annotations

import unicodedata
from pathlib import Path

import pytest

from keel.privacy import MasterKey
from keel.runtime import Agent
from keel.testing import ScriptedCall, ScriptedModel
from tests.privacy._samples import dump_sqlite

VALUES = {
    "EMAIL": "jörg.müller@bücher.example",
    "LOOKALIKE": "b\u043eb.stone@example.com",  # a Cyrillic o among Latin letters
    "CREDIT_CARD": "４１１１ １１１１ １１１１ １１１１",
    "PHONE": "4155552671",
}
MESSAGE = (
    f"Write to {VALUES['EMAIL']} or {VALUES['LOOKALIKE']}, charge my card "
    f"{VALUES['CREDIT_CARD']}, and call me at {VALUES['PHONE']} tomorrow."
)


def _forms(value: str) -> set[str]:
    """The value as written, in ASCII (NFKC) and without its spaces: each one a leak."""
    ascii_form = unicodedata.normalize("NFKC", value)
    return {value, ascii_form, ascii_form.replace(" ", ""), value.replace("\u3000", "")}


def _raw_in(data: str | bytes) -> list[str]:
    found = []
    for kind, value in VALUES.items():
        for form in _forms(value):
            needle: str | bytes = form.encode() if isinstance(data, bytes) else form
            if needle in data:  # type: ignore[operator]
                found.append(f"{kind} {form!r}")
    return found


@pytest.mark.parametrize("vault", [True, False], ids=["vault", "no-vault"])
async def test_unicode_addresses_fullwidth_card_and_bare_phone_are_never_stored_raw(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, vault: bool
) -> None:
    monkeypatch.setenv("KEEL_EMBEDDER", "hashing:64")
    if vault:
        monkeypatch.setenv("KEEL_PII_KEY", MasterKey.new_key_text())
    else:
        monkeypatch.delenv("KEEL_PII_KEY", raising=False)
    seen: list[str] = []

    def answer(call: ScriptedCall) -> str:
        seen.append(call.last_user_text)
        return "Noted."

    path = tmp_path / "keel.db"
    agent = Agent.open(f"sqlite:///{path}", model=ScriptedModel(answer), system_prompt="Help.")
    try:
        reply = await agent.run(MESSAGE, session="s1", user="alice")
        assert agent.memory is not None
        await agent.memory.aflush()
        if vault:  # it sealed each value whole, one row each, and forgets all four
            assert agent.vault is not None
            assert agent.vault.forget("default", "alice") == len(VALUES)
    finally:
        await agent.aclose()
    assert reply.status == "completed"
    assert _raw_in(seen[0]) == [], seen[0]
    for entity in ("EMAIL_1", "EMAIL_2", "CREDIT_CARD_1", "PHONE_1"):
        assert f"<{entity}>" in seen[0], seen[0]
    dumped = dump_sqlite(path)
    assert dumped.get("keel_state_checkpoints"), "the turn wrote nothing"
    assert {table: _raw_in(text) for table, text in dumped.items() if _raw_in(text)} == {}
    for file in (path, path.with_name(path.name + "-wal")):
        if file.exists():
            assert _raw_in(file.read_bytes()) == [], file.name
