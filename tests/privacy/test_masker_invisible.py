"""A value with invisible format characters inside it (a zero-width space, joiner or non-joiner,
a soft hyphen, a word joiner, a byte order mark: Unicode category Cf) is masked like the value
without them: the detectors read the text with them left out. The placeholder replaces the
value's whole original span, the invisible characters inside it included, and nothing outside
it: one just before or after the value stays. A long text whose other lines the masker knows
clean is judged the same way (its clean-lines memo reads the folded lines too)."""

from __future__ import annotations

import sys
import unicodedata

import pytest

from keel.privacy import PIIMasker, StreamMasker
from keel.privacy._detectors import fold

INVISIBLE = {
    "zero-width space": "\u200b",
    "zero-width non-joiner": "\u200c",
    "zero-width joiner": "\u200d",
    "soft hyphen": "\u00ad",
    "word joiner": "\u2060",
    "byte order mark": "\ufeff",
}

# (entity, the value with {i} where an invisible character goes, what it reads as)
VALUES = [
    ("EMAIL", "bob{i}@example.com"),
    ("EMAIL", "bob@exa{i}mple.com"),
    ("CREDIT_CARD", "4111{i}1111 1111 1111"),
    ("CREDIT_CARD", "4111 1111 11{i}11 1111"),
    ("PHONE", "+1 415{i}555 0132"),
    ("PHONE", "+1 415 555 01{i}32"),
]
CASES = [
    pytest.param(entity, value.format(i=char), id=f"{value}-{name}")
    for entity, value in VALUES
    for name, char in INVISIBLE.items()
]


@pytest.mark.parametrize(("entity", "value"), CASES)
def test_a_value_with_an_invisible_character_inside_is_masked_whole(
    entity: str, value: str
) -> None:
    masked = PIIMasker().mask_text(f"write to {value} today")
    assert masked == f"write to <{entity}_1> today"


@pytest.mark.parametrize(("entity", "value"), CASES)
def test_the_finding_is_the_original_span_invisible_characters_included(
    entity: str, value: str
) -> None:
    text = f"write to {value} today"
    found = PIIMasker().findings(text)
    assert [(f.entity, f.text, text[f.start : f.end]) for f in found] == [(entity, value, value)]


@pytest.mark.parametrize("char", INVISIBLE.values())
def test_invisible_characters_around_a_value_are_left_where_they_are(char: str) -> None:
    text = f"to{char} {char}bob@example.com{char} {char}and{char} call +1 415 555 0132{char}."
    masked = PIIMasker().mask_text(text)
    assert masked == f"to{char} {char}<EMAIL_1>{char} {char}and{char} call <PHONE_1>{char}."


def test_several_invisible_characters_in_several_values_keep_the_text_between_them() -> None:
    text = "a\u200bb bob\u200b\u200d@exam\u00adple.com, c\u2060d " + (
        "4111\ufeff1111\u200c1111 1111 e\u00adf"
    )
    assert PIIMasker().mask_text(text) == "a\u200bb <EMAIL_1>, c\u2060d <CREDIT_CARD_1> e\u00adf"


def test_every_format_character_of_this_unicode_database_is_read_as_absent() -> None:
    format_chars = "".join(
        chr(code) for code in range(sys.maxunicode + 1) if unicodedata.category(chr(code)) == "Cf"
    )
    assert fold(f"a{format_chars}b") == "ab"
    assert fold("a\u200bb\u00a0\uff11") == "ab 1"


def _long_text(line: str) -> str:
    known = [f"User: the zebra crossing by shelf {n} was repainted in spring." for n in range(12)]
    return "\n".join([*known, line])


@pytest.mark.parametrize("char", INVISIBLE.values())
def test_the_clean_lines_memo_reads_the_folded_lines(char: str) -> None:
    masker = PIIMasker()
    # The first text's lines are kept as clean, the second's new line is judged by the detectors.
    assert masker.mask_text(_long_text("nothing here")) == _long_text("nothing here")
    assert len(_long_text("x")) > 512
    # Only the detectors' folded reading finds the address: read raw, the line holds nothing.
    assert masker.mask_text(_long_text(f"mail bob{char}@example.com")) == _long_text(
        "mail <EMAIL_1>"
    )
    masked = masker.mask_text(_long_text(f"mail bob{char}@example.com or 4111{char}1111 1111 1111"))
    assert masked == _long_text("mail <EMAIL_1> or <CREDIT_CARD_1>")
    # A line with an invisible character is kept clean only when it holds nothing.
    line = f"the{char} zebra{char} is clean"
    assert masker.mask_text(_long_text(line)) == _long_text(line)
    assert masker.mask_text(_long_text(line + f" +1 415 555{char} 0132")).endswith("<PHONE_1>")


@pytest.mark.parametrize("char", INVISIBLE.values())
def test_a_streamed_value_with_an_invisible_character_is_never_released_raw(char: str) -> None:
    # Word by word, as an agent streams a reply: a word of digits with an invisible character
    # reads as digits (a card's group), so it is held back until the card is whole.
    stream = StreamMasker(PIIMasker().mask_text, by_word=True)
    pieces = ["card 4111", f"{char}1111 ", "1111 ", "1111 ", "ok now ", "and more"]
    released = "".join(stream.feed(piece) for piece in pieces)
    released += stream.finish()
    assert released == "card <CREDIT_CARD_1> ok now and more"


@pytest.mark.parametrize("count", [1, 8, 30])
def test_invisible_characters_before_values_never_hide_the_values_after_them(count: int) -> None:
    # The findings are told apart where the detectors found them: moved back to the text's
    # positions first, the address (found first) covered the phone number's folded span.
    text = "\u00ad" * count + "mail bob@example.com, call +1 415 555 0132 or 4111 1111 1111 1111"
    expected = "\u00ad" * count + "mail <EMAIL_1>, call <PHONE_1> or <CREDIT_CARD_1>"
    assert PIIMasker().mask_text(text) == expected


@pytest.mark.parametrize("by_word", [True, False])
def test_a_streamed_value_is_held_back_by_the_characters_the_detectors_read(by_word: bool) -> None:
    # Padded with zero-width spaces past the hold-back (64 characters counted with them), the
    # IBAN's first group was released raw, and nothing after it ever was.
    groups = ["GB82", "WEST", "1234", "5698", "7654", "32"]
    padded = " ".join(("\u200b" * 4).join(group) for group in groups)
    text = f"wire it to {padded} and that is all for today, see you soon"
    stream = StreamMasker(PIIMasker().mask_text, by_word=by_word)
    released = [stream.feed(char) for char in text]
    assert "GB82" not in "".join(released).replace("\u200b", "")
    assert "".join(released) + stream.finish() == PIIMasker().mask_text(text)
