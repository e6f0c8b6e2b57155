"""A value written in JSON's string escapes (a tool's output from ``json.dumps(...,
ensure_ascii=True)``: ``j\\u00f6rg@b\\u00fccher.example``, ``+1\\u00a0415...``, ``Bearer\\nTOKEN``)
is masked like the value written plainly: the detectors read the escapes decoded. The
placeholder replaces the value's whole span as written, each escape in it whole, and nothing
around it, so JSON stays JSON. Only what a JSON parser reads as an escape is decoded: an
escaped backslash is a backslash, and the text after it is text. The same value written
escaped, with an invisible character or plainly has one placeholder, in a text and in the
user's vault; a long text's clean-lines memo and a stream judge the escapes decoded too."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from keel.privacy import MaskingPolicy, MasterKey, PIIMasker, StreamMasker
from keel.privacy._detectors import fold
from keel.settings import load_settings
from keel.stores import Backends

TOKEN = "Q7wErTy8uIoP9aSdFgHj0kLz"
# (entity, the value as a tool has it, how it reads once json.dumps escaped it)
VALUES = [
    ("EMAIL", "jörg.müller@bücher.example", r"j\u00f6rg.m\u00fcller@b\u00fccher.example"),
    ("EMAIL", "иван.петров@пример.рф", None),
    ("PHONE", "+1\u00a0415\u00a0555\u00a00132", r"+1\u00a0415\u00a0555\u00a00132"),
    ("PHONE", "+49\u202f30\u202f1234\u202f5678", None),
    ("CREDIT_CARD", "4111\u00a01111\u00a01111\u00a01111", None),
    ("CREDIT_CARD", "４１１１ １１１１ １１１１ １１１１", None),
    ("CREDIT_CARD", "4111\u200b1111 1111 1111", r"4111\u200b1111 1111 1111"),
    ("EMAIL", "bob\u200b@example.com", None),
]
CASES = [
    pytest.param(entity, value, id=json.dumps(value)[1:-1][:24]) for entity, value, _ in VALUES
]


@pytest.mark.parametrize(("entity", "value"), CASES)
def test_an_escaped_value_is_masked_whole_and_the_json_stays_json(entity: str, value: str) -> None:
    written = json.dumps({"note": f"write to {value} today", "n": 1})
    assert "\\u" in written
    masked = PIIMasker().mask_text(written)
    assert masked == json.dumps({"note": f"write to <{entity}_1> today", "n": 1})
    assert json.loads(masked)["note"] == f"write to <{entity}_1> today"


@pytest.mark.parametrize(("entity", "value", "escaped"), [v for v in VALUES if v[2]])
def test_the_finding_is_the_escaped_span_and_its_value_the_decoded_one(
    entity: str, value: str, escaped: str
) -> None:
    written = json.dumps(f"to {value}.")
    [found] = PIIMasker().findings(written)
    assert (found.entity, found.text) == (entity, escaped)
    assert written[found.start : found.end] == escaped
    assert found.value == fold(value)


@pytest.mark.parametrize(
    ("before", "after"),
    [
        ("caf\u00e9 \u00ab", "\u00bb na\u00efve"),  # an escape just before and just after
        ("\U0001f600 ", " \U0001f44d"),  # surrogate pairs: twelve characters each
        ("\\", "\\"),  # escaped backslashes
        ('"', '"'),  # escaped quotes
        ("\t", "\n"),  # short escapes
        ("\u200b", "\u200b"),  # invisible, written escaped: around the value, so kept
    ],
)
def test_escapes_around_a_value_are_left_whole(before: str, after: str) -> None:
    text = f"{before}+1 415 555 0132{after} and {before}bob@example.com{after}"
    masked = PIIMasker().mask_text(json.dumps(text))
    assert masked == json.dumps(f"{before}<PHONE_1>{after} and {before}<EMAIL_1>{after}")


def test_several_escaped_values_in_a_document_keep_everything_between_them() -> None:
    document = {
        "customer": {"name": "Jörg Müller", "email": "jörg.müller@bücher.example"},
        "phones": ["+1\u00a0415\u00a0555\u00a00132", "+44\u00a020\u00a07946\u00a00958"],
        "card": "4111\u00a01111\u00a01111\u00a01111",
        "auth": f"Bearer\n{TOKEN}",
        "url": "https:\\/\\/example.com\\/r\u00e9sum\u00e9",
        "mood": "\U0001f600",
    }
    masked = PIIMasker().mask_text(json.dumps(document))
    assert json.loads(masked) == {
        "customer": {"name": "Jörg Müller", "email": "<EMAIL_1>"},
        "phones": ["<PHONE_1>", "<PHONE_2>"],
        "card": "<CREDIT_CARD_1>",
        "auth": "Bearer\n<BEARER_TOKEN_1>",
        "url": "https:\\/\\/example.com\\/r\u00e9sum\u00e9",
        "mood": "\U0001f600",
    }


def test_a_secret_split_by_an_escaped_line_break_or_slash_is_masked() -> None:
    slashed = TOKEN[:8] + "/" + TOKEN[8:]
    masked = PIIMasker().mask_text(json.dumps(f"Bearer\n{TOKEN} and bearer {slashed}"))
    assert masked == '"Bearer\\n<BEARER_TOKEN_1> and bearer <BEARER_TOKEN_2>"'
    # Escaped as some encoders write a slash: the token is one, not two halves.
    escaped = f'"authorization: Bearer {TOKEN[:8]}\\/{TOKEN[8:]}"'
    assert PIIMasker().mask_text(escaped) == '"authorization: Bearer <BEARER_TOKEN_1>"'


@pytest.mark.parametrize(
    ("written", "read"),
    [
        (r"j\u00f6rg", "jörg"),
        (r"j\u00F6rg", "jörg"),  # capital hex digits
        (r"j\\u0zf6rg", r"j\u0zf6rg"),  # an escaped backslash, then text
        (r"j\\\u00f6rg", "j\\örg"),  # an escaped backslash, then an escape
        # An escape escaped again (a JSON text in a JSON string) is decoded twice:
        # tests/privacy/test_masker_json_twice_escaped.py.
        (r"j\\u00f6rg", "jörg"),
        (r"a\"b\/c\\d\be\ff\ng\rh\ti", 'a"b/c\\d\be\ff\ng\rh\ti'),
        (r"\ud83d\ude00", "\U0001f600"),  # a surrogate pair: one character
        # A lone surrogate stands for itself, as json.loads reads it, and the fold reads it as
        # absent (half a character is no part of a value).
        (r"\ud83d x", " x"),
        (r"\ud83d\u0041", "A"),  # a high surrogate, then no low one
        (r"\u00g0 \x41 \a \' \u12 \U0001f600", r"\u00g0 \x41 \a \' \u12 \U0001f600"),  # none
        ("a\\", "a\\"),  # a backslash at the end
        (r"\uff14\u200b\u0031", "41"),  # decoded, then folded
    ],
)
def test_only_what_a_json_parser_reads_as_an_escape_is_decoded(written: str, read: str) -> None:
    assert fold(written) == read
    try:
        parsed = json.loads(f'"{written}"')
    except ValueError:
        return  # not JSON: a text with a backslash that starts no escape
    if "\\" not in parsed:  # else fold would read the backslash it holds as an escape again
        assert fold(parsed) == read  # read as a JSON parser reads it, then folded


def test_an_escaped_backslash_is_not_read_as_the_start_of_an_escape() -> None:
    # C:\nina@example.com, a Windows path written as JSON: the backslash is a backslash, and
    # the address after it starts at its "n" (read as "\n", it would start at "i").
    written = json.dumps("C:\\nina@example.com")
    assert written == r'"C:\\nina@example.com"'
    [found] = PIIMasker().findings(written)
    assert found.text == "nina@example.com"
    assert PIIMasker().mask_text(written) == r'"C:\\<EMAIL_1>"'


def test_a_value_after_one_written_longer_than_it_reads_is_found() -> None:
    # The findings were once compared in two texts' positions: the folded one and the one
    # written, which escapes and invisible characters make longer; the phone was dropped.
    assert PIIMasker().mask_text("b" + "\u200b" * 12 + "ob@example.com, call +1 415 555 0132") == (
        "<EMAIL_1>, call <PHONE_1>"
    )
    written = json.dumps({"to": "jörg.müller@bücher.example", "phone": "+1 415 555 0132"})
    assert json.loads(PIIMasker().mask_text(written)) == {"to": "<EMAIL_1>", "phone": "<PHONE_1>"}


def test_one_value_written_three_ways_has_one_placeholder_in_a_text() -> None:
    text = json.dumps("jörg@bücher.example") + " jörg@bücher.example jörg@b\u200bücher.example"
    result = PIIMasker().mask(text)
    assert result.text == '"<EMAIL_1>" <EMAIL_1> <EMAIL_1>'
    assert result.placeholders == {"<EMAIL_1>": "EMAIL"}


def test_an_allowed_value_is_allowed_escaped() -> None:
    masker = PIIMasker(MaskingPolicy(allow=frozenset({"jörg@bücher.example"})))
    written = json.dumps("write to jörg@bücher.example or ana@bücher.example")
    assert masker.mask_text(written) == json.dumps("write to jörg@bücher.example or <EMAIL_1>")


@pytest.fixture
def backends(tmp_path: Path) -> Iterator[Backends]:
    settings = load_settings(data_dir=tmp_path, embedder="hashing:64")
    opened = Backends.open(settings, memory=False, pii_key=MasterKey.generate())
    try:
        yield opened
    finally:
        opened.close()


def test_one_value_written_three_ways_has_one_placeholder_in_the_vault(
    backends: Backends,
) -> None:
    assert backends.vault is not None
    user_vault = backends.vault.user("acme", "u1")
    masker = PIIMasker()
    placed = [
        masker.mask_text(text, batch_numbering=user_vault.placeholders)
        for text in (
            "mail jörg@bücher.example",
            json.dumps({"to": "jörg@bücher.example"}),
            "mail jörg@b\u200bücher.example",
        )
    ]
    assert placed == ["mail <EMAIL_1>", '{"to": "<EMAIL_1>"}', "mail <EMAIL_1>"]
    # The vault keeps the value as it reads, which a tool is given: not its escapes.
    assert backends.vault.user("acme", "u1").values(["<EMAIL_1>"]) == {
        "<EMAIL_1>": "jörg@bücher.example"
    }


def _long_text(line: str) -> str:
    known = [f"User: the zebra crossing by shelf {n} was repainted in spring." for n in range(12)]
    return "\n".join([*known, line])


def test_the_clean_lines_memo_reads_the_escapes_decoded() -> None:
    masker = PIIMasker()
    assert masker.mask_text(_long_text("nothing here")) == _long_text("nothing here")
    # Read as written, neither line holds a value: the escapes hide them.
    card = json.dumps("4111\u00a01111\u00a01111\u00a01111")
    phone = json.dumps("+1\u00a0415\u00a0555\u00a00132")
    assert masker.mask_text(_long_text(f"card {card}")) == _long_text('card "<CREDIT_CARD_1>"')
    assert masker.mask_text(_long_text(f"call {phone}")) == _long_text('call "<PHONE_1>"')
    # A line with escapes is kept clean only when it holds nothing.
    line = json.dumps("the zebra\u00a0is clean\n")
    assert masker.mask_text(_long_text(line)) == _long_text(line)
    secret = json.dumps(f"{line} Bearer\n{TOKEN}")
    assert masker.mask_text(_long_text(secret)).endswith('Bearer\\n<BEARER_TOKEN_1>"')


STREAMED = json.dumps(
    {
        "to": "jörg.müller@bücher.example",
        "card": "4111\u00a01111\u00a01111\u00a01111",
        "quoted": "4111 1111 1111 1111",
        "phone": "+1\u00a0415\u00a0555\u00a00132",
        "auth": f"Bearer\n{TOKEN}",
        "note": "all done, thanks",
    }
)


@pytest.mark.parametrize("size", [1, 3, 5, 7])
@pytest.mark.parametrize("by_word", [True, False])
def test_a_stream_never_releases_an_escaped_value_nor_half_an_escape(
    size: int, by_word: bool
) -> None:
    masker = PIIMasker()
    whole = masker.mask_text(STREAMED)
    assert json.loads(whole)["card"] == "<CREDIT_CARD_1>"
    stream = StreamMasker(masker.mask_text, by_word=by_word)
    shown = ""
    for start in range(0, len(STREAMED), size):
        shown += stream.feed(STREAMED[start : start + size])
        assert whole.startswith(shown)  # no value, and no escape cut short, is released early
    assert shown + stream.finish() == whole


def test_a_stream_word_that_reads_as_two_is_judged_by_its_last() -> None:
    # "card\u00204111" reads "card 4111": its end may start a card, so it is held back;
    # "card" before the escaped space is a word that ends none, released.
    stream = StreamMasker(PIIMasker().mask_text, by_word=True)
    pieces = ["pay with ", "card\\u00204111 ", "1111 ", "1111 ", "1111 ", "thanks ", "more"]
    released = [stream.feed(piece) for piece in pieces]
    assert released[:3] == ["pay with", " card", ""]
    assert "".join(released) + stream.finish() == "pay with card\\u0020<CREDIT_CARD_1> thanks more"


def test_a_stream_holds_a_quoted_card_until_it_is_whole() -> None:
    stream = StreamMasker(PIIMasker().mask_text, by_word=True)
    pieces = ['{"card": ', '"4111 ', "1111 ", "1111 ", '1111", ', '"ok": 1}']
    released = [stream.feed(piece) for piece in pieces]
    assert released[:4] == ['{"card":', "", "", ""]
    assert "".join(released) + stream.finish() == '{"card": "<CREDIT_CARD_1>", "ok": 1}'


def test_a_stream_releases_a_word_whose_digits_follow_a_letter() -> None:
    # No card, phone number or IBAN starts right after a letter: "mp3" ends no such finding.
    stream = StreamMasker(PIIMasker().mask_text, by_word=True)
    assert stream.feed("play the mp3 ") == "play the mp3"
    assert stream.feed('or "4111 ') == " or"


def test_a_stream_holds_back_as_many_characters_as_the_detectors_read() -> None:
    # Every character escaped: the IBAN is 137 characters as written, its first four groups
    # 99, more than the 64 held back, and they hold no IBAN (nor anything else) on their own.
    groups = ["GB82", "WEST", "1234", "5698", "7654", "32"]
    iban = " ".join("".join(f"\\u{ord(char):04x}" for char in group) for group in groups)
    text = f"wire to {iban} today, and some more words to come"
    masker = PIIMasker()
    whole = masker.mask_text(text)
    assert whole == "wire to <IBAN_1> today, and some more words to come"
    stream = StreamMasker(masker.mask_text)
    shown = ""
    for start in range(0, len(text), 4):
        shown += stream.feed(text[start : start + 4])
        assert whole.startswith(shown)
    assert shown + stream.finish() == whole
