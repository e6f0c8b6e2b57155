"""StreamMasker when the text's escapes read another way late: a ``\\\\u00fc`` or an escaped
quote that arrives after a value was released makes the whole text decode twice (or its other
reading win), so the masked whole no longer starts with what was released. The rest of the
reply is still delivered, masked, and nothing raw is ever shown."""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from keel.privacy import PIIMasker, StreamMasker

_MASKER = PIIMasker()
_PLACEHOLDER = re.compile(r"<[A-Z][A-Z0-9_]*_[0-9]+>")

# A log line quoted twice escaped: "\\n" before the address reads as a line break (decoded
# twice) or as "\" then "nnina@..." (once): which, only the late "\\u00fc" tells.
_EARLY = "The log reads: Hello,\\\\nnina@example.com " + "is the address on file, " * 3
_LATE = "and the office is in Z\\\\u00fcrich. "


def _stream(text: str, sizes: list[int], *, by_word: bool = True) -> list[str]:
    stream = StreamMasker(
        lambda whole: _MASKER.mask_text(whole, remember=False),
        by_word=by_word,
        spans=_MASKER.mask_spans,
    )
    pieces: list[str] = []
    position, turn = 0, 0
    while position < len(text):
        size = sizes[turn % len(sizes)]
        turn += 1
        pieces.append(stream.feed(text[position : position + size]))
        position += size
    pieces.append(stream.finish())
    return pieces


def test_the_rest_is_delivered_when_a_late_escape_changes_how_the_text_reads() -> None:
    text = _EARLY + _LATE + "Write back any time, we answer within a day or two. Bye."
    pieces = _stream(text, [7])
    shown = "".join(pieces)
    assert "nina@" not in shown
    # Released as "\\<EMAIL_1>" (the once-decoded reading), and the rest as the whole masks it.
    assert shown.startswith("The log reads: Hello,\\\\<EMAIL_1> is the address")
    assert shown.endswith(_LATE + "Write back any time, we answer within a day or two. Bye.")
    # The rest streams on once the reading changed, not all at the end.
    after = "".join(pieces[: (len(_EARLY) + len(_LATE)) // 7 + 1])
    assert not after.endswith("Bye.") and "Write back" in "".join(pieces[:-1])


def test_a_value_the_whole_numbers_as_one_shown_for_another_gets_a_number_of_its_own() -> None:
    # Released: "\\<EMAIL_1>" for "nnina@example.com". The whole reads "nina@example.com" as
    # <EMAIL_1>: shown again later it must not read as the value already shown as <EMAIL_1>.
    text = _EARLY + _LATE + "Again: nina@example.com and bob@example.org, done. "
    shown = "".join(_stream(text, [5]))
    assert "nina@" not in shown and "bob@" not in shown
    assert shown.endswith("Again: <EMAIL_2> and <EMAIL_3>, done. ")
    assert _MASKER.mask_text(text).endswith("Again: <EMAIL_1> and <EMAIL_2>, done. ")


def test_a_renumbered_value_skips_a_placeholder_the_text_quotes() -> None:
    # As above, and the reply quotes <EMAIL_2> itself before the value: the renumbered value
    # must not take it (one quoted after it was released cannot be foreseen).
    text = _EARLY + _LATE + "As in <EMAIL_2>: again nina@example.com, done. "
    shown = "".join(_stream(text, [5]))
    assert "nina@" not in shown
    assert shown.endswith("As in <EMAIL_2>: again <EMAIL_3>, done. "), shown[-60:]


_VALUES = ("jane.doe@example.com", "bob@ex.org", "4111 1111 1111 1111", "(415) 555-0198")
# Before a value: escapes that read one way until a late one makes the text decode twice.
_EARLY_ESCAPES = ("\\\\n", "\\\\", "\\n", '\\"', " ", "")
# Late: a "\\uXXXX" or an escaped backslash (decoded twice), an escaped quote (the other
# reading wins), or none.
_LATE_ESCAPES = ("\\\\u0041", "\\\\\\\\", '\\\\"', '\\"', "\\u0041", "")
_WORDS = ("hello ", "to ", "the ", ", ", " ", "x")
_FILLER = "is what the record says, word for word, as it was written down. "
_END = " end of reply."


def _normalized(text: str) -> str:
    return _PLACEHOLDER.sub("<>", text)


def _common_prefix(one: str, other: str) -> int:
    size = 0
    for left, right in zip(one, other, strict=False):
        if left != right:
            break
        size += 1
    return size


@settings(max_examples=60, derandomize=True, deadline=None)
@given(
    early=st.lists(
        st.tuples(st.sampled_from(_EARLY_ESCAPES), st.sampled_from(_VALUES + _WORDS)),
        min_size=1,
        max_size=8,
    ),
    late=st.lists(st.sampled_from(_LATE_ESCAPES + _VALUES + _WORDS), max_size=8),
    filler=st.integers(min_value=0, max_value=2),
    sizes=st.lists(st.integers(min_value=1, max_value=9), min_size=1, max_size=8),
    by_word=st.booleans(),
)
def test_pieces_hold_no_raw_value_and_lose_no_text_when_the_reading_changes_late(
    early: list[tuple[str, str]],
    late: list[str],
    filler: int,
    sizes: list[int],
    by_word: bool,
) -> None:
    # Values behind escapes released first (the filler pushes them past the hold-back), then
    # escapes that may change how all of it reads.
    text = "".join(escape + value for escape, value in early) + " " + _FILLER * filler
    text += "".join(late) + _END
    whole = _MASKER.mask_text(text)
    pieces = _stream(text, sizes, by_word=by_word)
    shown = "".join(pieces)
    # No value the whole masks is shown as written (one the detectors do not read as a value
    # where it stands, glued to a word, is shown as the whole shows it).
    for written in {finding.text for finding in _MASKER.findings(text)}.union(_VALUES):
        if written not in whole:
            assert written not in shown, (written, shown)
    assert shown.endswith(_END), shown
    # Where the reading changed, what was shown differs from the whole around one value at
    # most (a character read into it, its number): the rest of the whole is all there.
    mine, theirs = _normalized(shown), _normalized(whole)
    same = _common_prefix(mine, theirs) + _common_prefix(mine[::-1], theirs[::-1])
    assert same >= len(theirs) - max(map(len, _VALUES)), (shown, whole)
