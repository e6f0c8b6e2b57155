"""Numbers whose label says what they are: an SSN written without its dashes after "SSN" or
"social security number", and a phone number after a "tel:" or "phone:" with no space (a
link's ``href="tel:+1..."``, a vCard's field) are masked; a time or a score after a colon,
and an SSN no one is given, stay."""

from __future__ import annotations

import pytest

from keel.privacy import PIIMasker, StreamMasker
from keel.runtime import Agent
from keel.settings import load_settings
from keel.testing import ScriptedModel
from tests.privacy._samples import dump_sqlite, fed_in_pieces

MASKED = [
    ("SSN: 536221234, on file.", "SSN: <US_SSN_1>, on file."),
    ("my ssn is 536 22 1234", "my ssn is <US_SSN_1>"),
    ("Social Security No. 078.05.1120", "Social Security No. <US_SSN_1>"),
    ('{"ssn": "536221234"}', '{"ssn": "<US_SSN_1>"}'),
    ('<a href="tel:+14155550132">Call</a>', '<a href="tel:<PHONE_1>">Call</a>'),
    ("phone:+1-415-555-0132; TEL:+44 20 7946 0958", "phone:<PHONE_1>; TEL:<PHONE_2>"),
]

KEPT = [
    "at 12:30:45, time:12:30, score:+15, ratio 3:+1",
    "SSN: 000123456 and ssn 666-12-3456 are not issued",
    "the ssn field holds 536-221234",  # groups that are not an SSN's
    "order 536221234 shipped",  # nine digits with no label
]


@pytest.mark.parametrize(("text", "masked"), MASKED)
def test_a_labelled_number_is_masked(text: str, masked: str) -> None:
    assert PIIMasker().mask_text(text) == masked


@pytest.mark.parametrize("text", KEPT)
def test_what_no_label_makes_a_value_stays(text: str) -> None:
    assert PIIMasker().mask_text(text) == text


@pytest.mark.parametrize("by_word", [True, False])
def test_a_streamed_labelled_ssn_is_never_shown_in_part(by_word: bool) -> None:
    text = "Thanks! Your ssn is 536 22 1234 and we call tel:+14155550132 today, ok."
    whole = PIIMasker().mask_text(text)
    assert whole == "Thanks! Your ssn is <US_SSN_1> and we call tel:<PHONE_1> today, ok."
    for cuts in ([1], [2, 3], [5, 1, 4]):
        stream = StreamMasker(PIIMasker().mask_text, by_word=by_word)
        assert fed_in_pieces(stream, text, cuts) == whole


async def test_no_table_holds_a_labelled_ssn_or_a_tel_link() -> None:
    agent = Agent.embedded(ScriptedModel(lambda call: "Saved."), system_prompt="s", memory=True)
    try:
        reply = await agent.handle(
            "s1", "u1", 'SSN: 536221234; reach me via <a href="tel:+14155550132">here</a>'
        )
    finally:
        await agent.aclose()
    assert reply.status == "completed"
    path = load_settings().sqlite_path
    assert path is not None
    dumped = dump_sqlite(path)
    assert dumped.get("keel_state_checkpoints") and dumped.get("memory_records")
    found = [t for t, text in dumped.items() if "536221234" in text or "4155550132" in text]
    assert found == []
