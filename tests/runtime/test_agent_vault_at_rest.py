"""The issue's at-rest check on SQLite, through ``Agent``: after turns whose user text, tool
output and model output carry a value of every PII kind, with memory on, no raw value is in any
row of any table, in the bytes of the database file or its write-ahead log, in keel's DEBUG
logs or in the agent's monitor; the vault's tables hold only ciphertext. The values still reach
the tool that needs them and the user's reply."""

from __future__ import annotations

import json
import logging
import re
import sqlite3
from pathlib import Path

import pytest

from keel.privacy import ENTITY_TYPES, MasterKey, PIIMasker
from keel.runtime import Agent
from keel.testing import ScriptedCall, ScriptedModel
from keel.tools import tool
from tests.privacy._samples import (
    MODEL_PII,
    TOOL_PII,
    USER_PII,
    _raw_forms,
    dump_sqlite,
    leaks,
    sentence,
)

_JWT_HEAD = "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIiwibmFtZSI6IkpvaG4ifQ."
_MORE = {
    "user": (
        "8f14e45fceea167a5a36dedd4bea2543",
        "192.168.1.10",
        "SflKxwRJSMeKKF2QT4fwpMeJf36POk6yJV_adQssw5c",
        "MIIEpAIBAAKCAQEA1c7+9z5Pad7OejecsQ0bu3aumgyu",
        "Vx7!harbor-Lamp9",
        ("Marisol", "1984-02-29", "X4721956", "D5520317", "4417 Quenby Lane"),
    ),
    "tool": (
        "c9f0f895fb98ab9159f51fd0297e236d",
        "10.20.30.40",
        "Tq2mZ8vNc4Lp0Wx7Rb3Ks6Jd9Fh1Gy5Ue2Ia8Oz4Cn",
        "MIIEowIBAAKCAQEAz9Qx3Lm7Rt2Vb8Nc5Kp1Wy6Hd4Jg",
        "Qm4#granite_Owl2",
        ("Oyelaran", "1990-11-05", "P8830142", "S7761045", "98 Harrowgate Road"),
    ),
    "model": (
        "45c48cce2e2d7fbdea1afc51c7c6ad26",
        "172.16.4.20",
        "Hn6Yb2Qw9Ep4Rt7Uy1Io3Pa5Sd8Fg0Jk2Lz6Xc9Vb4",
        "MIIEogIBAAKCAQEAq1Wz7Ex3Rc9Tv5Yb2Un8Im4Ok6Pl",
        "Ry2%meadow.Fox81",
        ("Tavish", "1977-07-17", "C01X00T47", "W4409981", "250 Kestrel Avenue"),
    ),
}
"""Per source, the kinds ``_samples`` has no value of: a bearer token, an IP address, a JWT's
signature (its header and claims are the same in every JWT), a private key's body, a
password (given after its label), and personal data found by its label: a name, a date of
birth, a passport and a driver's licence number, a street address."""


def _with_more(values: dict[str, str], source: str) -> dict[str, str]:
    bearer, address, signature, key_body, password, personal = _MORE[source]
    name, birth, passport, licence, street = personal
    return {
        "PERSON": name,
        "DATE_OF_BIRTH": birth,
        "PASSPORT": passport,
        "DRIVER_LICENSE": licence,
        "ADDRESS": street,
        **values,
        "BEARER_TOKEN": bearer,
        "IP_ADDRESS": address,
        "JWT": _JWT_HEAD + signature,
        "PRIVATE_KEY": key_body,
        "SECRET": password,
    }


USER, TOOL, MODEL = (
    _with_more(USER_PII, "user"),
    _with_more(TOOL_PII, "tool"),
    _with_more(MODEL_PII, "model"),
)
SETS = (USER, TOOL, MODEL)


def _text(values: dict[str, str]) -> str:
    """One text carrying every value of the set (every kind of ``ENTITY_TYPES``)."""
    return (
        f"{sentence(values)}; send Authorization: Bearer {values['BEARER_TOKEN']} to "
        f"{values['IP_ADDRESS']}, password: {values['SECRET']} token {values['JWT']}, "
        "key -----BEGIN RSA PRIVATE KEY-----\n"
        f"{values['PRIVATE_KEY']}\n-----END RSA PRIVATE KEY-----\n"
        f"My name is {values['PERSON']}, DOB: {values['DATE_OF_BIRTH']}, passport no. "
        f"{values['PASSPORT']}, driver's license: {values['DRIVER_LICENSE']}; ship to "
        f"{values['ADDRESS']}."
    )


@pytest.fixture(autouse=True)
def _environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEEL_PII_KEY", MasterKey.new_key_text())
    monkeypatch.setenv("KEEL_EMBEDDER", "hashing:64")


def _file_leaks(path: Path) -> list[str]:
    """``'KIND value in FILE'`` for every raw value in the bytes of the file and its WAL."""
    found: list[str] = []
    for file in (path, path.with_name(path.name + "-wal")):
        if not file.exists():
            continue
        data = file.read_bytes()
        for values in SETS:
            for kind, value in values.items():
                for form in _raw_forms(value):
                    for encoded in (form.encode(), form.encode("utf-16-le")):
                        if encoded in data:
                            found.append(f"{kind} {form!r} in {file.name}")
    return found


def test_the_samples_are_every_pii_kind_and_each_is_masked() -> None:
    for values in SETS:
        assert set(values) == set(ENTITY_TYPES)
        masked = PIIMasker().mask_text(_text(values))
        assert sorted(re.findall(r"<([A-Z_]+)_1>", masked)) == sorted(ENTITY_TYPES), masked


async def test_no_raw_value_anywhere_after_turns_carrying_every_pii_kind(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    received: list[str] = []

    @tool(side_effect=True)  # journalled too
    def lookup_customer(email: str) -> str:
        """Look the customer up.

        Args:
            email: Their address.
        """
        received.append(email)
        return "found: " + _text(TOOL)

    def answer(call: ScriptedCall) -> str:
        # The model writes raw values of its own (as a model may) beside what it was shown.
        return "Done. " + _text(MODEL) + " Thanks."

    model = ScriptedModel(
        [
            ScriptedModel.tool_call("lookup_customer", json.dumps({"email": "<EMAIL_1>"})),
            answer,
            "Noted again.",
        ]
    )
    path = tmp_path / "keel.db"
    caplog.set_level(logging.DEBUG, logger="keel")
    agent = Agent.open(
        f"sqlite:///{path}", model=model, system_prompt="You help.", tools=[lookup_customer]
    )
    try:
        reply = await agent.run(_text(USER), session="s1", user="alice")
        await agent.run("and again: " + _text(USER), session="s1", user="alice")
        assert agent.memory is not None
        await agent.memory.aflush()
        monitor = repr(agent.monitor.snapshot(agent=agent.name))
        open_leaks = _file_leaks(path)
    finally:
        await agent.aclose()
    dumped = dump_sqlite(path)
    assert dumped.get("memory_records"), "memory wrote nothing"
    assert leaks(dumped, *SETS) == []
    assert open_leaks == [] and _file_leaks(path) == []
    assert leaks({"logs": caplog.text, "monitor": monitor}, *SETS) == []
    # The values did their work: the tool got the address, the user reads the model's answer.
    assert received == [USER["EMAIL"]]
    assert reply.text == "Done. " + _text(MODEL) + " Thanks."
    # The vault holds every value, sealed: one row per distinct value, none readable.
    with sqlite3.connect(path) as conn:
        (rows,) = conn.execute("SELECT COUNT(*) FROM keel_pii_values").fetchone()
    assert rows == sum(len(values) for values in SETS)
