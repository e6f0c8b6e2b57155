"""StreamMasker: a text masked as it arrives in pieces shows no PII early and splits no
placeholder; the pieces put together are the masked whole."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from keel.privacy import PIIMasker, StreamMasker

_MASKER = PIIMasker()

_SECRETS = (
    "jane.doe@example.com",
    "(415) 555-0198",
    "4111 1111 1111 1111",
    "GB82 WEST 1234 5698 7654 32",
    "sk-proj-abcdefghijklmnopqrstuvwxyz012345",
    "-----BEGIN PRIVATE KEY-----\nMIIEvQIBADAN BgkqhkiG9w0B AQEFAASC\n-----END PRIVATE KEY-----",
)
_WORDS = ("Hello", "your", "booking", "is", "confirmed.", "Call", "or", "write", "to", "\n")
# Digit groups that complete a card or a phone number only together with their neighbours.
_DIGITS = ("4111", "1111", "555", "0198", "(415)", "GB82", "WEST")


@given(
    parts=st.lists(st.sampled_from(_SECRETS + _WORDS + _DIGITS), min_size=1, max_size=40),
    cuts=st.lists(st.integers(min_value=1, max_value=15), min_size=1, max_size=30),
    by_word=st.booleans(),
)
def test_pieces_show_no_pii_early_and_add_up_to_the_masked_whole(
    parts: list[str], cuts: list[int], by_word: bool
) -> None:
    text = " ".join(parts)
    whole = _MASKER.mask_text(text)
    stream = StreamMasker(_MASKER.mask_text, by_word=by_word)
    shown = ""
    position, turn = 0, 0
    while position < len(text):
        size = cuts[turn % len(cuts)]
        turn += 1
        shown += stream.feed(text[position : position + size])
        position += size
        # Released text is the start of the masked whole: no raw PII, no half placeholder.
        assert whole.startswith(shown)
        for secret in _SECRETS:
            assert secret.split()[0][:8] not in shown or secret.split()[0] in _DIGITS
    shown += stream.finish()
    assert shown == whole
    assert stream.released == whole


def test_plain_text_is_released_while_it_streams() -> None:
    stream = StreamMasker(_MASKER.mask_text, hold_chars=8)
    text = "one two three four five six seven eight nine ten"
    shown = [stream.feed(text[i : i + 3]) for i in range(0, len(text), 3)]
    assert any(shown[:-1]), "nothing was released before the end"
    assert "".join(shown) + stream.finish() == text


def test_by_word_releases_each_word_once_it_is_followed_by_a_space() -> None:
    stream = StreamMasker(_MASKER.mask_text, by_word=True)
    assert stream.feed("Hello") == ""
    assert stream.feed(" there, mail") == "Hello there,"
    assert stream.feed(" jane.doe@exa") == " mail"
    assert stream.feed("mple.com and call 415 555") == " <EMAIL_1> and call"
    assert stream.feed(" 0198 now ") == " <PHONE_1> now"
    assert stream.finish() == " "


def test_the_built_in_policy_streams_by_word_and_custom_detectors_do_not() -> None:
    import re

    from keel.privacy import Detector

    assert PIIMasker().streams_by_word()
    names = Detector("PERSON", re.compile(r"\bJohn Smith\b"))
    assert not PIIMasker(extra_detectors=[names]).streams_by_word()
