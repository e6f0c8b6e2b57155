"""RevealStream: a streamed text with a user's placeholders revealed, whatever the pieces: no
placeholder is split between two releases, and the releases add up to the revealed whole."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from keel.privacy import PLACEHOLDER, RevealStream
from tests.privacy._samples import fed_in_pieces

_VALUES = {"<EMAIL_1>": "alice@example.com", "<PHONE_12>": "+1 415 555 0198"}
_PARTS = (*_VALUES, "<EMAIL_9>", "<", "<EMAIL", "_1", ">", "a < b", "x<y", "Hi", " ", "\n")


def _reveal(text: str) -> str:
    return PLACEHOLDER.sub(lambda match: _VALUES.get(match.group(0), match.group(0)), text)


@given(
    parts=st.lists(st.sampled_from(_PARTS), min_size=1, max_size=30),
    cuts=st.lists(st.integers(min_value=1, max_value=9), min_size=1, max_size=20),
)
def test_pieces_never_split_a_placeholder_and_add_up_to_the_revealed_whole(
    parts: list[str], cuts: list[int]
) -> None:
    text = "".join(parts)
    seen: list[str] = []

    def reveal(segment: str) -> str:
        seen.append(segment)
        return _reveal(segment)

    shown = fed_in_pieces(RevealStream(reveal), text, cuts)
    assert shown == _reveal(text)
    assert "".join(seen) == text
    # Every placeholder of the whole lies inside one revealed segment.
    boundaries, at = set(), 0
    for segment in seen[:-1]:
        at += len(segment)
        boundaries.add(at)
    for match in PLACEHOLDER.finditer(text):
        assert not any(match.start() < cut < match.end() for cut in boundaries), (seen, match)


def test_text_without_an_open_placeholder_is_released_at_once() -> None:
    stream = RevealStream(_reveal)
    assert stream.feed("Hello <EMAIL_1>, a < b") == "Hello alice@example.com, a < b"
    assert stream.feed(" and <EMA") == " and "
    assert stream.feed("IL_1> done") == "alice@example.com done"
    assert stream.finish() == ""


def test_a_long_run_after_a_bracket_is_not_held_for_ever() -> None:
    stream = RevealStream(_reveal, max_held_chars=16)
    assert stream.feed("<" + "A" * 20) == "<" + "A" * 20
