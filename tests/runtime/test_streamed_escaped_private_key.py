"""A model that writes a PEM private key inside a JSON string (its line breaks as ``\\n``)
with its ``-----BEGIN`` escaped (``\\u002d``) or an invisible character in it: the stream held
back the block only where ``-----BEGIN`` stood as written, so the key's lines streamed raw
before its END line came and the mask could cover it. Nothing of the key streams; the reply
streamed is the masked whole."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from keel.runtime import TextDelta
from keel.stores import SQLiteDatabase
from keel.testing import ScriptedModel
from tests.runtime.conftest import sqlite_agent

BODY = "\n".join(f"MIIEpAIBAAKCAQEAx7Qw9ZtLk3vYhq8sR2mNpW4cF6uJ0bE1dX5yGaT3oK{n}" for n in range(6))
PEM = f"-----BEGIN RSA PRIVATE KEY-----\n{BODY}\n-----END RSA PRIVATE KEY-----"
WRITTEN = json.dumps({"key": PEM})  # its line breaks escaped: "-----\\nMIIE..."


@pytest.mark.parametrize(
    "answer",
    [
        WRITTEN.replace("-----BEGIN", "\\u002d" * 5 + "BEGIN"),  # escaped dashes
        WRITTEN.replace("BEGIN", "BEG\\u200bIN"),  # an escaped zero-width space
        WRITTEN.replace("BEGIN", "BEG\u2060IN"),  # a word joiner as written
    ],
    ids=["escaped-dashes", "escaped-zero-width", "word-joiner"],
)
async def test_a_streamed_private_key_in_json_escapes_is_held_back_whole(
    tmp_path: Path, answer: str
) -> None:
    reply_text = f"Here is the stored secret: {answer} and that is all of it for now."
    with SQLiteDatabase(tmp_path / "keel.db") as sqlite:
        agent = sqlite_agent(sqlite, ScriptedModel(lambda call: reply_text))  # streams masked
        events = [event async for event in agent.stream("Show it.", session="s1", user="u1")]
    reply = events[-1].reply  # type: ignore[union-attr]
    deltas = [event.text for event in events if isinstance(event, TextDelta)]
    streamed = "".join(deltas)
    assert len(deltas) > 1, "the reply did not stream"
    assert "MIIE" not in streamed, streamed
    assert streamed == reply.text and "<PRIVATE_KEY_1>" in reply.text, streamed
