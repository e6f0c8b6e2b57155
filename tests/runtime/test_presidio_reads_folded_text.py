"""With Presidio on (``MaskingPolicy(presidio=True)``), its analyzer read the text as written
while the built-in detectors read it decoded and folded: a customer's name in a tool's
``json.dumps`` output (``J\\u00f6rg M\\u00fcller``) or with a zero-width space inside reached
the database raw, and a span found in the escapes could end inside one. Presidio now reads the
text the detectors read, its spans moved back. Presidio is not installed here: a stand-in
analyzer at the one seam (``_load_presidio``) finds the names it knows, as Presidio's
recognizers would in the text they are given."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from keel.messages import Message, ToolCall
from keel.privacy import MaskingPolicy, PIIMasker
from keel.runtime import Agent
from keel.testing import ScriptedCall, ScriptedModel
from keel.tools import tool
from tests.privacy._samples import dump_sqlite, leaks

NAMES = {"PERSON": "Jörg Müller", "LOCATION": "Zürich Oerlikon"}
CUSTOMER = {"name": NAMES["PERSON"], "city": "Zürich\u200b Oerlikon", "tier": "gold"}
shown: list[str] = []


@dataclass
class _Result:
    entity_type: str
    start: int
    end: int
    score: float


class _Analyzer:
    """Finds the names it knows in the text it is given, as Presidio's analyzer does."""

    def analyze(self, text: str, language: str) -> list[_Result]:
        found = []
        for entity, name in NAMES.items():
            for match in re.finditer(re.escape(name), text):
                found.append(_Result(entity, match.start(), match.end(), 0.85))
        return found


@tool(side_effect=True, idempotent=False)
def look_up_customer(customer_id: str) -> str:
    """Look a customer up (journalled: it has an effect).

    Args:
        customer_id: The customer's id.
    """
    return json.dumps(CUSTOMER)  # ensure_ascii=True: "J\\u00f6rg M\\u00fcller"


def _reply(call: ScriptedCall) -> Message | str:
    results = [m for m in call.messages if m.role == "tool"]
    if results:
        shown.extend(str(m.content) for m in results)
        return "Found them."
    arguments = json.dumps({"customer_id": "c-17"})
    return Message.assistant(
        "", tool_calls=[ToolCall(id="c1", name="look_up_customer", arguments=arguments)]
    )


def _forms(value: str) -> set[str]:
    return {value, json.dumps(value)[1:-1]}


@pytest.fixture
def masker(monkeypatch: pytest.MonkeyPatch) -> Iterator[PIIMasker]:
    shown.clear()
    analyzer: Any = _Analyzer()
    monkeypatch.setattr("keel.privacy._masker._load_presidio", lambda: analyzer)
    yield PIIMasker(MaskingPolicy(presidio=True))


async def test_presidio_finds_names_in_json_escapes_and_nothing_raw_is_stored(
    tmp_path: Path, masker: PIIMasker
) -> None:
    database = tmp_path / "keel.db"
    agent = Agent.open(
        f"sqlite:///{database}",
        system_prompt="You look customers up.",
        model=ScriptedModel(_reply),
        tools=[look_up_customer],
        masker=masker,
    )
    try:
        reply = await agent.run("Who is customer c-17?", session="s1", user="u1")
    finally:
        await agent.aclose()
    assert reply.status == "completed", reply
    dumped = dump_sqlite(database)
    assert "look_up_customer" in dumped["keel_tool_journal"]
    assert leaks(dumped, NAMES, {"CITY": CUSTOMER["city"]}, forms=_forms) == []
    [output] = shown
    assert json.loads(output) == {"name": "<PERSON_1>", "city": "<LOCATION_1>", "tier": "gold"}


def test_a_presidio_span_is_moved_back_whole_and_numbered_by_its_value(masker: PIIMasker) -> None:
    written = json.dumps({"a": NAMES["PERSON"]}) + f" and {NAMES['PERSON']} again"
    found = [(finding.text, finding.value) for finding in masker.findings(written)]
    assert found == [
        ("J\\u00f6rg M\\u00fcller", NAMES["PERSON"]),  # the escapes whole, the value read
        (NAMES["PERSON"], NAMES["PERSON"]),
    ]
    assert masker.mask_text(written) == '{"a": "<PERSON_1>"} and <PERSON_1> again'
