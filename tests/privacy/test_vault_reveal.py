"""UserVault.reveal: the user's own placeholders shown as their values (read in one go), any
other placeholder left as written."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from keel.privacy import MasterKey, Vault, placeholders_in
from keel.runtime import Agent
from keel.stores import SQLiteDatabase
from keel.stores._sqlite_vault import SQLiteVaultStore
from keel.testing import ScriptedCall, ScriptedModel


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


PEM = "-----BEGIN EC PRIVATE KEY-----\nMHcCAQEEIBkg4u\n-----END EC PRIVATE KEY-----"


def test_a_json_text_stays_json_when_a_value_with_line_breaks_and_quotes_is_revealed() -> None:
    with tempfile.TemporaryDirectory() as directory:
        database = SQLiteDatabase(Path(directory) / "keel.db")
        try:
            ada = Vault(SQLiteVaultStore(database), MasterKey.generate()).user("acme", "ada")
            key, quoted = ada.placeholder("PRIVATE_KEY", PEM), ada.placeholder("NAME", 'a "b" \\')
            text = json.dumps({"key": key, "items": [f"{quoted} and {key}"], key: 1})
            assert json.loads(ada.reveal(text)) == {
                "key": PEM,
                "items": [f'a "b" \\ and {PEM}'],
                PEM: 1,
            }
            # Not a JSON text: the values as they are, line breaks and all.
            assert ada.reveal(f"key: {key}") == f"key: {PEM}"
            assert ada.reveal(f"{{key: {key}}}") == f"{{key: {PEM}}}"
        finally:
            database.close()


def _answer_in_json(call: ScriptedCall) -> str:
    shown = placeholders_in(call.last_user_text)
    assert len(shown) == 1  # the model is shown the key as a placeholder
    return json.dumps({"saved": True, "key": shown[0]})


async def test_an_agents_json_reply_reveals_a_private_key_as_json() -> None:
    agent = Agent.embedded(ScriptedModel(_answer_in_json), system_prompt="Answer in JSON.")
    try:
        reply = await agent.handle("s1", "ada", f"save my key:\n{PEM}\nplease")
    finally:
        await agent.aclose()
    assert reply.status == "completed"
    assert json.loads(reply.text) == {"saved": True, "key": PEM}
