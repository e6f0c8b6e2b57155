"""Personal data found by its label or its place: a date of birth, a passport or driver's
licence number, a street address, a person's name. Each is masked where the text says what it
is, word by word for a name and as its street line for an address; what only looks like one
(a meeting's date, "2 Google Drive files", ``first_name: Optional[str]``) stays."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keel.privacy import ENTITY_TYPES, MaskingPolicy, MasterKey, PIIMasker, StreamMasker
from keel.runtime import Agent
from keel.settings import load_settings
from keel.testing import ScriptedModel
from keel.tools import tool
from tests.privacy._samples import dump_sqlite, fed_in_pieces

MASKED = [
    ("DOB: 1985-03-14", "DOB: <DATE_OF_BIRTH_1>"),
    ("date of birth: 14/03/1985.", "date of birth: <DATE_OF_BIRTH_1>."),
    ("I was born on March 14, 1985 in Leeds", "I was born on <DATE_OF_BIRTH_1> in Leeds"),
    ('{"dob": "1990-04-05"}', '{"dob": "<DATE_OF_BIRTH_1>"}'),
    ("my birthday is 3/14/85", "my birthday is <DATE_OF_BIRTH_1>"),
    ("born on the 14th of March 1985", "born on the <DATE_OF_BIRTH_1>"),
    ("passport no. X1234567", "passport no. <PASSPORT_1>"),
    ("Passport Number: 123456789", "Passport Number: <PASSPORT_1>"),
    ("my passport number is C01X00T47", "my passport number is <PASSPORT_1>"),
    ("driver's license: D1234567", "driver's license: <DRIVER_LICENSE_1>"),
    ("Driving licence number MORGA753116SM9IJ", "Driving licence number <DRIVER_LICENSE_1>"),
    ("driver\u2019s licence # 123-456-789", "driver\u2019s licence # <DRIVER_LICENSE_1>"),
    ("I live at 42 Baker Street, London NW1 6XE", "I live at <ADDRESS_1>, London NW1 6XE"),
    (
        '"address1": "380 Chestnut Street", "address2": "Suite 569", "zip": "46281"',
        '"address1": "<ADDRESS_1>", "address2": "Suite 569", "zip": "46281"',
    ),
    (
        "1600 Pennsylvania Ave NW, Washington, DC 20500",
        "<ADDRESS_1>, Washington, DC 20500",
    ),
    ("Send it to 221B Baker St., Apt 2", "Send it to <ADDRESS_1>, Apt 2"),
    ("my name is Jane Doe", "my name is <PERSON_1> <PERSON_2>"),
    (
        '{"first_name": "Yusuf", "last_name": "Rossi"}',
        '{"first_name": "<PERSON_1>", "last_name": "<PERSON_2>"}',
    ),
    (
        "The customer's name is John and he called",
        "The customer's name is <PERSON_1> and he called",
    ),
    ("my name is Jos\u00e9 van der Berg", "my name is <PERSON_1> van der <PERSON_2>"),
    ("cardholder name: MARIA GARCIA", "cardholder name: <PERSON_1> <PERSON_2>"),
    ("Hi. I am Yusuf Rossi, zip 19122.", "Hi. I am <PERSON_1> <PERSON_2>, zip 19122."),
    (
        "My name is Jane Doe. Jane likes tea.",
        "My name is <PERSON_1> <PERSON_2>. <PERSON_1> likes tea.",
    ),
]

KEPT = [
    "The meeting is on 2023-05-07 at 10:30; the build of 14/03/2024 passed.",
    "I was born in 1985, in Paris; born on 31/31/1985 is no date",
    "my passport is expired; passport: ABCDEFGH; the passport office",
    "driver's license: pending",
    "we have 2 Google Drive files and 3 Main Street Journal issues",
    "Chapter 12 The Long Way; at 3 PM Eastern Time",
    "first_name: Optional[str] = None; last_name = Column(String)",
    "your first name is required; name: Build and Test; my name is not important",
    "user.first_name = request.form['first']",
    "I am American; I'm Sorry; I am the owner; I am mei_kovacs_8020",
]


@pytest.mark.parametrize(("text", "masked"), MASKED)
def test_personal_data_is_masked_by_its_label_or_place(text: str, masked: str) -> None:
    assert PIIMasker().mask_text(text) == masked


@pytest.mark.parametrize("text", KEPT)
def test_what_only_looks_like_personal_data_stays(text: str) -> None:
    assert PIIMasker().mask_text(text) == text


def test_the_new_kinds_are_entity_types_a_policy_can_leave_out() -> None:
    kinds = {"DATE_OF_BIRTH", "PASSPORT", "DRIVER_LICENSE", "ADDRESS", "PERSON"}
    assert kinds <= set(ENTITY_TYPES)
    masker = PIIMasker()
    masker.set_policy("t1", MaskingPolicy(entities=frozenset(ENTITY_TYPES) - {"PERSON"}))
    assert masker.mask_text("my name is Jane", tenant_id="t1") == "my name is Jane"
    assert masker.mask_text("my name is Jane") == "my name is <PERSON_1>"


STREAMED = [
    "Thanks! I live at 42 Baker Street, London NW1 6XE and was born on March 14, 1985, ok?",
    "Ship it to 1600 Pennsylvania Ave NW, Washington, DC 20500 please, my name is Jane Doe.",
    "My passport number is C01X00T47 and my driver's license: D1234567 thanks",
    "Jane here. Hi, I am Yusuf Rossi and my name is Jane Doe, so Jane and Yusuf it is.",
]


@pytest.mark.parametrize("by_word", [True, False])
@pytest.mark.parametrize("text", STREAMED)
def test_a_streamed_value_is_never_shown_in_part(text: str, by_word: bool) -> None:
    whole = PIIMasker().mask_text(text)
    assert whole.count("<") >= 2
    for cuts in ([1], [2, 3], [5, 1, 4], [7]):
        stream = StreamMasker(PIIMasker().mask_text, by_word=by_word)
        shown = fed_in_pieces(stream, text, cuts)
        assert shown == whole, cuts


async def test_no_table_holds_the_personal_data_a_user_gave() -> None:
    said = (
        "Hi, my name is Yusuf Rossi, DOB: 1985-03-14, passport no. X1234567. "
        "Please ship to 380 Chestnut Street, Indianapolis, IN 46281."
    )
    agent = Agent.embedded(ScriptedModel(lambda call: "Saved."), system_prompt="s", memory=True)
    try:
        reply = await agent.handle("s1", "u1", said)
    finally:
        await agent.aclose()
    assert reply.status == "completed"
    path = load_settings().sqlite_path
    assert path is not None
    dumped = dump_sqlite(path)
    assert dumped.get("keel_state_checkpoints") and dumped.get("memory_records")
    values = ("Yusuf", "Rossi", "1985-03-14", "X1234567", "380 Chestnut")
    found = [(table, v) for table, text in dumped.items() for v in values if v in text]
    assert found == []


async def test_a_tool_gets_a_first_and_a_last_name_apart_and_the_user_reads_them_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A name is masked word by word, so the model can give a tool its first and its last
    name apart, as placeholders; the tool gets the values, the store holds neither."""
    monkeypatch.setenv("KEEL_PII_KEY", MasterKey.new_key_text())
    received: list[tuple[str, str]] = []

    @tool
    def find_user(first_name: str, last_name: str) -> str:
        """Find a customer by name.

        Args:
            first_name: Their first name.
            last_name: Their last name.
        """
        received.append((first_name, last_name))
        return "user_id: cust_77"

    model = ScriptedModel(
        [
            ScriptedModel.tool_call(
                "find_user", json.dumps({"first_name": "<PERSON_1>", "last_name": "<PERSON_2>"})
            ),
            "Found you, <PERSON_1> <PERSON_2>.",
        ]
    )
    path = tmp_path / "keel.db"
    agent = Agent.open(f"sqlite:///{path}", model=model, system_prompt="s", tools=[find_user])
    try:
        reply = await agent.run("Hi. I am Yusuf Rossi in zip code 19122.", session="s", user="u")
    finally:
        await agent.aclose()
    assert received == [("Yusuf", "Rossi")]
    assert reply.text == "Found you, Yusuf Rossi."
    dumped = dump_sqlite(path)
    assert [table for table, text in dumped.items() if "Yusuf" in text or "Rossi" in text] == []


_PIECES = st.sampled_from(
    [
        *("my name is ", "I am ", "I'm ", "Jane", "Doe", "Rossi", " ", ", ", ". ", "\n", "and "),
        *("42 ", "221B ", "Baker ", "Elm ", "Street", "St.", " NW", ", London NW1 6XE", "Suite 5"),
        *(", Springfield, IL 62704", "ship to ", "I live at ", "born on ", "DOB: ", "March "),
        *("14, ", "14th of ", "1985", "1990-01-02", "passport no. ", "X1234567", "lives "),
        *('{"first_name": "', '", ', "Apt 4B", "3 ", "the ", "(", "Google Drive ", "at "),
    ]
)


@settings(max_examples=150, deadline=None)
@given(
    pieces=st.lists(_PIECES, min_size=1, max_size=25),
    cuts=st.lists(st.integers(1, 9), min_size=1, max_size=4),
    by_word=st.booleans(),
)
def test_any_streamed_text_shows_what_its_whole_masks(
    pieces: list[str], cuts: list[int], by_word: bool
) -> None:
    text = "".join(pieces)
    stream = StreamMasker(PIIMasker().mask_text, by_word=by_word)
    assert fed_in_pieces(stream, text, cuts) == PIIMasker().mask_text(text)
