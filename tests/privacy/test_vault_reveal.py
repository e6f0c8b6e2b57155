"""UserVault.reveal: the user's own placeholders shown as their values (read in one go), any
other placeholder left as written."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keel.privacy import MasterKey, RevealStream, UserVault, Vault, placeholders_in
from keel.runtime import Agent, TextDelta, TurnFinished
from keel.stores import SQLiteDatabase
from keel.stores._sqlite_vault import SQLiteVaultStore
from keel.testing import ScriptedCall, ScriptedModel
from tests.privacy._samples import fed_in_pieces


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


async def test_an_agents_json_reply_reveals_a_private_key_as_json_streamed_or_not() -> None:
    model = ScriptedModel(_answer_in_json)
    model.stream_chunk_chars = 3
    agent = Agent.embedded(model, system_prompt="Answer in JSON.")
    try:
        reply = await agent.handle("s1", "ada", f"save my key:\n{PEM}\nplease")
        deltas: list[str] = []
        finished = None
        async for event in agent.stream(f"again:\n{PEM}", session="s2", user="ada"):
            if isinstance(event, TextDelta):
                deltas.append(event.text)
            elif isinstance(event, TurnFinished):
                finished = event.reply
    finally:
        await agent.aclose()
    assert reply.status == "completed"
    assert json.loads(reply.text) == {"saved": True, "key": PEM}
    assert finished is not None and json.loads(finished.text) == {"saved": True, "key": PEM}
    assert "".join(deltas) == finished.text


_WHOLE_VALUES = {"PRIVATE_KEY": PEM, "NAME": 'Jo "JJ" O\\Neil', "EMAIL": "jo@example.com"}


@pytest.fixture(scope="module")
def ada() -> Iterator[UserVault]:
    with tempfile.TemporaryDirectory() as directory:
        database = SQLiteDatabase(Path(directory) / "keel.db")
        try:
            yield Vault(SQLiteVaultStore(database), MasterKey.generate()).user("acme", "ada")
        finally:
            database.close()


def _placed(ada: UserVault) -> dict[str, str]:
    return {ada.placeholder(kind, value): value for kind, value in _WHOLE_VALUES.items()}


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    before=st.sampled_from(["", " ", 'a \\" b ', "\\\\", "\\u0041 "]),
    cuts=st.lists(st.integers(min_value=1, max_value=7), min_size=1, max_size=12),
)
def test_a_streamed_json_text_is_revealed_as_the_whole_is_and_stays_json(
    ada: UserVault, before: str, cuts: list[int]
) -> None:
    placed = _placed(ada)
    key, name, email = placed
    # ``before``: a string's text as JSON writes it (an escaped quote, an escaped backslash).
    text = f'\n{{\n "key": "{key}",\n "{before}{name}": ["{before}{email} and {key}"], "n": 1}}'
    shown = fed_in_pieces(RevealStream(ada.reveal), text, cuts)
    assert shown == ada.reveal(text)
    decoded = json.loads(shown)
    assert decoded["key"] == PEM
    assert json.loads(ada.reveal(text)) == decoded


def test_prose_and_a_value_outside_strings_are_revealed_as_they_are(ada: UserVault) -> None:
    key, name, _ = _placed(ada)
    for text in (f'He said "{key}" twice', f"[1] {key}", f'{{"a": 1}} {name}'):
        stream = RevealStream(ada.reveal)
        shown = stream.feed(text) + stream.finish()
        assert (
            shown == ada.reveal(text) == text.replace(key, PEM).replace(name, _WHOLE_VALUES["NAME"])
        )
