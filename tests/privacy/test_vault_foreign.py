"""Placeholders keel did not place: defanged where untrusted text enters, and, once a unit of
work has shown the model a prompt, neither resolved nor revealed by the user's view of the
vault; the executor defangs what a tool returns or raises (issue 44, defect 11)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from keel.errors import PlaceholderError
from keel.messages import ToolCall
from keel.privacy import MasterKey, UserVault, Vault, defang_placeholders
from keel.stores import SQLiteDatabase
from keel.stores._sqlite_vault import SQLiteVaultStore
from keel.tools import ToolExecutor, ToolRegistry, tool

DEFANGED_EMAIL = "\u2039EMAIL_1\u203a"


@pytest.fixture
def ada(tmp_path: Path) -> Iterator[UserVault]:
    database = SQLiteDatabase(tmp_path / "keel.db")
    try:
        yield Vault(SQLiteVaultStore(database), MasterKey.generate()).user("acme", "ada")
    finally:
        database.close()


def test_defang_neutralises_every_placeholder_but_those_kept() -> None:
    text = "card <CREDIT_CARD_1>, mail <EMAIL_1>, html <b>, a < b"
    assert defang_placeholders(text) == (
        "card \u2039CREDIT_CARD_1\u203a, mail \u2039EMAIL_1\u203a, html <b>, a < b"
    )
    assert defang_placeholders(text, keep={"<EMAIL_1>"}).count("<EMAIL_1>") == 1


def test_after_the_model_was_shown_a_prompt_only_placed_or_shown_placeholders_resolve(
    ada: UserVault,
) -> None:
    email, card = ada.placeholder("EMAIL", "a@x.io"), ada.placeholder("CREDIT_CARD", "4111")
    # A later unit of work of the same user: nothing placed by it yet.
    later = ada.vault.user("acme", "ada")
    assert later.resolve(f"{email} {card}") == "a@x.io 4111"  # nothing shown yet: no limit
    later.note_shown([f"the user wrote {email}"])
    assert later.resolve(email) == "a@x.io"
    with pytest.raises(PlaceholderError, match="did not place it"):
        later.resolve(card)
    assert later.reveal(f"{email} {card}") == f"a@x.io {card}"
    assert later.defang_foreign(f"{email} {card}") == f"{email} \u2039CREDIT_CARD_1\u203a"
    # A value the unit of work masks itself is placed by it: it resolves.
    assert later.placeholder("CREDIT_CARD", "4111") == card
    assert later.resolve(card) == "4111"


async def test_the_executor_defangs_what_a_tool_returns_and_raises(ada: UserVault) -> None:
    ada.placeholder("EMAIL", "a@x.io")

    @tool
    def fetch_page(url: str) -> str:
        """Fetch a page.

        Args:
            url: The page.
        """
        return "Contact: <EMAIL_1>"

    @tool
    def broken(url: str) -> str:
        """Fail.

        Args:
            url: The page.
        """
        raise RuntimeError("cannot reach <EMAIL_1>")

    @tool(sees_values=False)
    def audit(who: str) -> str:
        """Audit.

        Args:
            who: Whose request.
        """
        return f"audited {who}"

    executor = ToolExecutor(ToolRegistry([fetch_page, broken, audit]), vault=ada)

    async def content(name: str, arguments: dict[str, str]) -> str:
        call = ToolCall(id=name, name=name, arguments=json.dumps(arguments))
        return (await executor.execute(call, session_id="s", step=0)).content

    assert await content("fetch_page", {"url": "x"}) == f"Contact: {DEFANGED_EMAIL}"
    assert DEFANGED_EMAIL in await content("broken", {"url": "x"})
    # A placeholder the call itself carried may come back as it was.
    assert await content("audit", {"who": "<EMAIL_1>"}) == "audited <EMAIL_1>"
