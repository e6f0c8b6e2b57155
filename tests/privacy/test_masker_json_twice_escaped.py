"""JSON encoded twice: a JSON text held in a JSON string (``json.dumps({"content":
json.dumps(...)})``, what a tool or an MCP server returns as JSON text once wrapped again, and
what keel writes when a tool's result holds a JSON text) carries its values behind two levels
of escapes: ``j\\\\u00f6rg``, ``4111\\\\u00201111``. Once decoded they still read as escapes, so
the detectors read the text decoded again; the placeholder covers the value's whole span as
written, each doubly escaped character in it whole, and the result is JSON at both levels."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keel.privacy import PIIMasker, StreamMasker
from keel.privacy._detectors import fold, fold_map

TOKEN = "Q7wErTy8uIoP9aSdFgHj0kLz"
INNER = {
    "to": "jörg.müller@bücher.example",
    "card": "4111\u00a01111\u00a01111\u00a01111",
    "phone": "+1\u00a0415\u00a0555\u00a00132",
    "auth": f"Bearer\n{TOKEN}",
    "name": "Jörg",
}
MASKED = {
    "to": "<EMAIL_1>",
    "card": "<CREDIT_CARD_1>",
    "phone": "<PHONE_1>",
    "auth": "Bearer\n<BEARER_TOKEN_1>",
    "name": "Jörg",
}


def test_a_json_text_in_a_json_string_is_masked_and_stays_json_at_both_levels() -> None:
    written = json.dumps({"content": json.dumps(INNER)})
    assert "j\\\\u00f6rg.m\\\\u00fcller" in written  # two levels of escapes, as the brief's
    masked = PIIMasker().mask_text(written)
    assert json.loads(json.loads(masked)["content"]) == MASKED
    assert masked == json.dumps({"content": json.dumps(MASKED)})


def test_each_finding_is_the_doubly_escaped_span_whole() -> None:
    written = json.dumps({"content": json.dumps({"to": INNER["to"], "card": INNER["card"]})})
    email, card = PIIMasker().findings(written)
    assert email.text == r"j\\u00f6rg.m\\u00fcller@b\\u00fccher.example"
    assert card.text == r"4111\\u00a01111\\u00a01111\\u00a01111"
    assert (email.value, card.value) == ("jörg.müller@bücher.example", "4111 1111 1111 1111")
    assert written[email.start - 2 : email.start] == '\\"'  # the quote before, left whole
    assert written[email.end : email.end + 2] == '\\"'


@pytest.mark.parametrize(
    ("before", "after"),
    [
        ("caf\u00e9 ", " na\u00efve"),  # a doubly escaped character just before and after
        ("\U0001f600", "\U0001f44d"),  # surrogate pairs, escaped again
        ("\\", "\\"),  # backslashes: four in the text
        ("\u00e9 \t", "\n"),  # short escapes, in a text that holds a \\uXXXX once decoded
    ],
)
def test_doubly_escaped_characters_around_a_value_are_left_whole(before: str, after: str) -> None:
    text = f"{before}+1 415 555 0132{after} {before}bob@example.com{after}"
    masked = PIIMasker().mask_text(json.dumps({"content": json.dumps(text)}))
    expected = f"{before}<PHONE_1>{after} {before}<EMAIL_1>{after}"
    assert masked == json.dumps({"content": json.dumps(expected)})


def test_the_escapes_as_written_by_hand_are_masked() -> None:
    # Written as the brief had it: a space as its escape, which json.dumps never writes.
    written = (
        r'{"content": "{\"to\": \"j\\u00f6rg.m\\u00fcller@b\\u00fccher.example\", '
        r'\"card\": \"4111\\u00201111\\u00201111\\u00201111\"}"}'
    )
    masked = PIIMasker().mask_text(written)
    assert masked == r'{"content": "{\"to\": \"<EMAIL_1>\", \"card\": \"<CREDIT_CARD_1>\"}"}'
    inner = json.loads(json.loads(masked)["content"])
    assert inner == {"to": "<EMAIL_1>", "card": "<CREDIT_CARD_1>"}


def test_a_json_text_wrapped_three_times_is_masked() -> None:
    written = json.dumps({"c": json.dumps({"content": json.dumps(INNER)})})
    masked = PIIMasker().mask_text(written)
    assert json.loads(json.loads(json.loads(masked)["c"])["content"]) == MASKED


@pytest.mark.parametrize(
    ("written", "read"),
    [
        (r"j\\u00f6rg", "jörg"),  # twice
        (r"C:\\nina", "C:\\nina"),  # a Windows path once: only \uXXXX or \\ is read twice
        (r"C:\\\\nina \\u00f6", "C:\\nina ö"),  # the same path, twice
        (r"j\\\\u00f6rg", "jörg"),  # three times
        (r"j\\uzzzz", "j\\uzzzz"),  # no escape once decoded: read as it reads
    ],
)
def test_a_text_is_decoded_again_only_while_it_still_holds_escapes(written: str, read: str) -> None:
    assert fold(written) == read


def test_the_position_map_goes_through_both_levels() -> None:
    written = r"a\\u00f6b\\u00fc"  # reads "aöbü"
    folded, positions = fold_map(written)
    assert folded == "aöbü" and positions is not None
    assert [positions.span(at, at + 1) for at in range(4)] == [(0, 1), (1, 8), (8, 9), (9, 16)]
    assert [positions.index(at) for at in (0, 1, 4, 8, 9, 16)] == [0, 1, 2, 2, 3, 4]


def test_once_escaped_json_reads_as_before() -> None:
    written = json.dumps({"path": "C:\\nina@example.com", "to": INNER["to"]})
    assert json.loads(PIIMasker().mask_text(written)) == {
        "path": "C:\\<EMAIL_1>",
        "to": "<EMAIL_2>",
    }


def _streamed_by_word(written: str, size: int) -> str:
    """``written`` masked whole, after checking that a stream fed ``size`` characters at a time
    releases only starts of it, and all of it in the end."""
    masker = PIIMasker()
    whole = masker.mask_text(written)
    stream = StreamMasker(masker.mask_text, by_word=True)
    shown = ""
    for start in range(0, len(written), size):
        shown += stream.feed(written[start : start + size])
        assert whole.startswith(shown)
    assert shown + stream.finish() == whole
    return whole


@pytest.mark.parametrize("size", [1, 7])
def test_a_stream_never_releases_a_doubly_escaped_value(size: int) -> None:
    written = json.dumps({"content": json.dumps(INNER)})
    _streamed_by_word(written, size)


@pytest.mark.parametrize(
    ("entity", "value"),
    [
        ("CREDIT_CARD", "4111 1111 1111 1111"),
        ("IBAN", "GB82 WEST 1234 5698 7654 32"),
        ("API_KEY", "sk-live-Zx9Cv8Bn7Mq6Wr5Ty4Ui3Op2"),
        ("EMAIL", "bob@example.com"),
        ("PHONE", "+1 415 555 0132"),
    ],
)
@pytest.mark.parametrize("escape", ["\n", "\t", "\r", '"'])
def test_a_value_after_a_short_escape_in_json_encoded_twice_is_masked(
    entity: str, value: str, escape: str
) -> None:
    # ASCII only: once decoded, no \uXXXX and no escaped backslash is left, only "\n" (say),
    # which read as written glued the value to a letter ("n4111": no card; "nbob@...": the
    # placeholder after a lone backslash, and the inner JSON no longer JSON).
    text = f"on file:{escape}{value}{escape} ok"
    written = json.dumps({"content": json.dumps({"note": text})})
    masked = PIIMasker().mask_text(written)
    expected = f"on file:{escape}<{entity}_1>{escape} ok"
    assert masked == json.dumps({"content": json.dumps({"note": expected})})
    assert json.loads(json.loads(masked)["content"])["note"] == expected


def test_a_stream_reads_a_word_as_the_whole_text_reads_it() -> None:
    # Alone, the word "hello\\nGB82" reads "hello\nGB82" (a backslash, an "n": no IBAN can
    # start in "nGB82"); in the JSON text held in a JSON string it reads "hello", a line
    # break, "GB82": the IBAN's first group, which must not be released before the rest.
    inner = {"a": "caf\u00e9", "n": "ok hello\nGB82 WEST 1234 5698 7654 32 ok"}
    written = json.dumps({"content": json.dumps(inner)})
    masker = PIIMasker()
    whole = masker.mask_text(written)
    assert "<IBAN_1>" in whole
    stream = StreamMasker(masker.mask_text, by_word=True)
    cut = written.index("GB82 ") + len("GB82 ")
    shown = stream.feed(written[:cut])
    assert whole.startswith(shown), shown
    assert shown + stream.feed(written[cut:]) + stream.finish() == whole


_VALUES = {
    "GB82 WEST 1234 5698 7654 32": "IBAN",
    "4111 1111 1111 1111": "CREDIT_CARD",
    "+1 415 555 0132": "PHONE",
    "bob@example.com": "EMAIL",
}
_WORDS = ["ok", "hello", "Card:", "caf\u00e9", "\U0001f600", "C:\\nina", "ID"]


@settings(max_examples=60, derandomize=True, deadline=None)
@given(
    parts=st.lists(
        st.tuples(st.sampled_from(_WORDS), st.sampled_from([*_VALUES, ""])), min_size=1, max_size=5
    ),
    breaks=st.lists(st.sampled_from([" ", "\n", "\t", ", "]), min_size=10, max_size=10),
    levels=st.integers(1, 2),
    size=st.integers(1, 9),
)
def test_a_stream_of_json_releases_only_the_start_of_the_masked_whole(
    parts: list[tuple[str, str]], breaks: list[str], levels: int, size: int
) -> None:
    # Words and values, each after a line break, a tab or a space, in JSON once or twice: what
    # a stream releases is always the start of the masked whole, and holds no value.
    text = "".join(
        f"{word}{breaks[i]}{value}{breaks[-1 - i]}" for i, (word, value) in enumerate(parts)
    )
    written = json.dumps({"note": text})
    if levels == 2:
        written = json.dumps({"content": written})
    whole = _streamed_by_word(written, size)
    for value, entity in _VALUES.items():
        assert value.split(" ")[0] not in fold(whole), (value, whole)
        assert (f"<{entity}_" in whole) == any(value == part[1] for part in parts)


def test_a_json_text_in_a_json_string_with_short_escapes_only_is_read_decoded_twice() -> None:
    # No \uXXXX once decoded, only "\n": read as written once, the address would start at the
    # "n" and its mask leave the inner JSON a lone backslash ("\<EMAIL_1>"); the text's quotes
    # escaped say it is JSON encoded twice, so the reading decoded twice places the spans.
    inner = {"note": "mail\nbob@example.com\ncard\n4111 1111 1111 1111"}
    written = json.dumps({"content": json.dumps(inner)})
    masked = PIIMasker().mask_text(written)
    assert json.loads(json.loads(masked)["content"]) == {
        "note": "mail\n<EMAIL_1>\ncard\n<CREDIT_CARD_1>"
    }
    # Without escaped quotes a backslash before a letter is first a backslash (a Windows path),
    # and what only the other reading finds is masked too.
    assert PIIMasker().mask_text(r"C:\\nina@example.com \\n4111 1111 1111 1111") == (
        r"C:\\<EMAIL_1> \\n<CREDIT_CARD_1>"
    )
