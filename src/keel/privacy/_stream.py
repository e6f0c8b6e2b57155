"""Masking text that arrives in pieces: a placeholder is never split, PII never leaks early.

A streamed reply cannot be masked piece by piece: ``jane.doe@`` and ``example.com`` are harmless
apart, a phone number can arrive one digit group at a time, and placeholders are numbered in
order of appearance over the whole text (``<EMAIL_2>`` means the second address). So
[`StreamMasker`][] masks everything received so far, each time, and releases only a prefix
that more text can no longer change:

* it ends at whitespace (no e-mail, key or token crosses it) at least ``hold_chars`` before the
  end of what was received, which is longer than any pattern that spans whitespace (IBANs,
  cards and phone numbers in groups), both counted as the detectors read the text (a value in
  JSON escapes, ``\\u0034\\u0031...``, is longer as written); with ``by_word``, it may also
  end right after a word that ends in a character none of those patterns can contain (a
  lowercase letter, a comma, say), or in ones none starts with after such a character: no
  such pattern can run on past that word, so a reply streams word by word;
* nothing from a ``-----BEGIN`` block the mask has not masked (a PEM private key whose end
  has not arrived) onwards, whatever its length, found as the detectors read the text (an
  invisible character or a JSON escape in it hides nothing); nor from a value that spans
  words and may be unfinished: a quoted credential whose quote has not closed, a street
  line whose street type has not come ("I live at 42 Baker"), a date of birth in words
  whose year has not;
* the masked prefix must be the start of the masked whole, so a finding still open across it
  holds it back.

What is released is therefore the start of ``mask(whole text)``, and `finish` releases the
rest: the pieces put together are the masked whole. But how a text's escapes read can change
late: a ``\\uXXXX`` or an escaped backslash that arrives after a value was released makes the
whole decode twice, an escaped quote makes its other reading win (`fold_readings`), and the
masked whole may no longer start with what was released (``\\<EMAIL_1>`` shown where the whole
reads ``\\n<EMAIL_1>``), nor number its values as they were shown. Released text is never sent
again, and the rest is never dropped: from then on (with ``spans``, a [`PIIMasker`][]'s
``mask_spans``) the raw text after what was released is masked by the findings of the whole
text received, in its context (a finding that began in the released text is masked for the
rest of it), under the same cuts; a value keeps the placeholder it was shown with, and one
the whole numbers as a value already shown gets the next free number. Without ``spans``,
`finish` masks that rest on its own.

[`RevealStream`][] goes the other way, for a user's vault: it shows a streamed text with the
user's own placeholders replaced by their values, holding back an unfinished ``<...`` until it
closes or can no longer be a placeholder, so a placeholder is never split across two pieces
and each one is revealed whole.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from keel.privacy._detectors import FoldMap, fold_readings, open_quoted_secret
from keel.privacy._json_strings import JsonStrings, inside, json_escaped
from keel.privacy._personal import open_personal_value
from keel.privacy._vault import PLACEHOLDER

__all__ = ["RevealStream", "StreamMasker"]

_BLOCK_START = "-----BEGIN"


class StreamMasker:
    """Masks a text received in pieces; see the module docstring.

    Args:
        mask: the masking function (a [`PIIMasker`][]'s ``mask_text``, or any
            function of the whole text whose findings do not span more than ``hold_chars``
            across whitespace).
        hold_chars: characters always held back from the end of what was received.
        max_word_chars: a run of text without whitespace longer than this is released up to
            ``hold_chars`` from its end (an e-mail address is at most 254 characters).
        by_word: release up to the end of a word that no whitespace-spanning pattern can
            run on past, without the hold-back. Only for masks whose findings that span whitespace
            are made of digits, capitals and ``+()-./:``, or are held back while unfinished
            (a street line, a date of birth in words: the built-in detectors'; see
            [`PIIMasker.streams_by_word`][]).
        spans: what ``mask`` replaces in a text, where and by what (a [`PIIMasker`][]'s
            ``mask_spans``, with the same policy): how the rest is masked once the masked
            whole no longer starts with what was released (see the module docstring).
    """

    def __init__(
        self,
        mask: Callable[[str], str],
        *,
        hold_chars: int = 64,
        max_word_chars: int = 512,
        by_word: bool = False,
        spans: MaskSpans | None = None,
    ) -> None:
        if hold_chars < 1 or max_word_chars <= hold_chars:
            raise ValueError("need 1 <= hold_chars < max_word_chars")
        self._mask = mask
        self._spans = spans
        self.by_word = by_word
        self.hold_chars = hold_chars
        self.max_word_chars = max(max_word_chars, 256 + hold_chars)
        self._received: list[str] = []
        self._text = ""
        self._released = ""
        self._cut_at = 0  # where in the received text the released part ends
        # Once the masked whole no longer starts with what was released (`_diverged`): the
        # placeholder shown for each value (see `MaskSpans`), so the rest keeps to it.
        self._diverged = False
        self._shown: dict[str, str] = {}

    @property
    def released(self) -> str:
        """The masked text released so far."""
        return self._released

    def feed(self, piece: str) -> str:
        """Take ``piece``; return the masked text that can be shown now ('' when none)."""
        if not piece:
            return ""
        self._text += piece
        cut = self._cut()
        if cut <= self._cut_at:
            return ""
        if not self._diverged:
            head = self._mask(self._text[:cut])
            if head.startswith(self._released):
                if len(head) == len(self._released):
                    return ""
                if not self._mask(self._text).startswith(head):
                    return ""  # a finding is still open across the cut: wait for more text
                new = head[len(self._released) :]
                self._released = head
                self._cut_at = cut
                return new
            if self._spans is None:
                return ""  # `finish` releases the rest, masked on its own
            self._diverge()
        return self._release_masked(cut)

    def finish(self) -> str:
        """Everything not released yet, masked (the stream ended)."""
        if not self._diverged:
            whole = self._mask(self._text)
            if whole.startswith(self._released):
                new = whole[len(self._released) :]
                self._released = whole
                self._cut_at = len(self._text)
                return new
            if self._spans is None:
                # The rest masked on its own: it is never lost, and never re-sends what was
                # shown.
                new = self._mask(self._text[self._cut_at :])
                self._released += new
                self._cut_at = len(self._text)
                return new
            self._diverge()
        return self._release_masked(len(self._text))

    def _diverge(self) -> None:
        """The text read so far no longer masks as it did when its start was released (its
        escapes read another way now): from here on the rest is masked by the findings of
        the whole text (`_release_masked`), after the raw text already released."""
        self._diverged = True
        assert self._spans is not None
        # Until now what was released was the masked text up to `_cut_at`, whole.
        for _start, _end, placeholder, value in self._spans(self._text[: self._cut_at]):
            self._shown.setdefault(value, placeholder)

    def _release_masked(self, cut: int) -> str:
        """The raw text from `_cut_at` to ``cut`` masked by the findings of the whole text
        received ('' when a finding runs on past ``cut``, or reads otherwise in the text up
        to ``cut`` alone: more text may change it); its placeholders kept to those shown."""
        assert self._spans is not None
        text, start = self._text, self._cut_at
        found = _spans_between(self._spans(text), start, cut)
        if found is None:
            return ""
        if cut < len(text):
            alone = _spans_between(self._spans(text[:cut]), start, cut)
            if alone is None or _positions(alone) != _positions(found):
                return ""
        pieces: list[str] = []
        cursor = start
        for span_start, span_end, placeholder, value in found:
            # A finding that began in the released text: the rest of it is masked too.
            pieces.append(text[cursor : max(span_start, cursor)])
            pieces.append(self._placeholder(placeholder, value))
            cursor = span_end
        pieces.append(text[cursor:cut])
        new = "".join(pieces)
        self._released += new
        self._cut_at = cut
        return new

    def _placeholder(self, placeholder: str, value: str) -> str:
        """The placeholder to show for ``value``: the one shown before, else the whole's
        unless it was shown for another value (renumbered then: the next free number)."""
        shown = self._shown.get(value)
        if shown is not None:
            return shown
        # Taken: the placeholders shown for other values, and those the text itself holds
        # (a reply quoting one it was shown), which the whole's numbering skips too.
        taken = set(self._shown.values())
        numbered = _NUMBERED.fullmatch(placeholder)
        if placeholder in taken and numbered is not None:
            taken.update(match.group(0) for match in _NUMBERED.finditer(self._text))
            entity, number = numbered.group(1), int(numbered.group(2))
            while f"<{entity}_{number}>" in taken:
                number += 1
            placeholder = f"<{entity}_{number}>"
        self._shown[value] = placeholder
        return placeholder

    def _open_block(self, folded: str, positions: FoldMap | None) -> int | None:
        """Where the first ``-----BEGIN`` block the mask has not masked (yet) starts, found in
        the text as the detectors read it (``folded``): written with an invisible character
        inside or in JSON escapes (``\\u002d----BEGIN``), the mask masks it once it ends, and
        its body must not be released before."""
        text = self._text
        start = folded.find(_BLOCK_START)
        while start != -1:
            begin, end = start, start + len(_BLOCK_START)
            if positions is not None:
                begin, end = positions.span(begin, end)
            if self._mask(text[begin:]).startswith(text[begin:end]):
                return begin
            start = folded.find(_BLOCK_START, start + 1)
        return None

    def _cut(self) -> int:
        """Where the releasable prefix of the received text ends (0: nowhere yet)."""
        # The block and both cuts are found in the text as the detectors read it (`fold`),
        # whole: how an escape reads depends on the rest of the text (``\\n`` is a line break
        # in a JSON text held in a JSON string, which a word read alone cannot tell).
        # Where the escapes read two ways (`fold_readings`: short escapes left once decoded),
        # only what both readings release is released.
        return min(
            self._cut_in(folded, positions) for folded, positions in fold_readings(self._text)
        )

    def _cut_in(self, folded: str, positions: FoldMap | None) -> int:
        """`_cut` in one reading of the received text."""
        block = self._open_block(folded, positions)
        quoted = open_quoted_secret(folded)
        personal = open_personal_value(folded)
        if personal is not None:
            quoted = personal if quoted is None else min(quoted, personal)
        if quoted is not None:
            if positions is not None:
                at_end = quoted >= len(folded)
                quoted = len(self._text) if at_end else positions.span(quoted, quoted + 1)[0]
            block = quoted if block is None else min(block, quoted)
        cut = self._held_back_cut(folded, positions, block)
        if self.by_word:
            floor = self._cut_at if positions is None else positions.index(self._cut_at)
            word_end = _last_safe_word_end(folded, floor)
            if word_end > 0 and positions is not None:
                word_end = positions.span(word_end, word_end + 1)[0]
            if block is None or word_end <= block:
                cut = max(cut, word_end)
        return cut

    def _held_back_cut(self, folded: str, positions: FoldMap | None, block: int | None) -> int:
        """The last whitespace at least ``hold_chars`` before the end (and before ``block``),
        both counted in the text as the detectors read it (``folded``): a value written in JSON
        escapes is up to six times as long (``\\u0034\\u0031...``), its whitespace may be an
        escape (``\\u0020``, ``\\n``), and a cut never falls inside an escape."""
        if positions is None:
            return self._whitespace_cut(folded, block)
        cut = self._whitespace_cut(folded, None if block is None else positions.index(block))
        return positions.span(cut, cut + 1)[0] if cut > 0 else 0

    def _whitespace_cut(self, text: str, block: int | None) -> int:
        limit = len(text) - self.hold_chars
        if block is not None:
            limit = min(limit, block)
        if limit <= 0:
            return 0
        space = max(text.rfind(char, 0, limit) for char in _WHITESPACE)
        if space > 0 and limit - space <= self.max_word_chars:
            return space
        # A very long run without whitespace: release it up to the hold-back.
        return limit if limit - max(space, 0) > self.max_word_chars else 0


MaskSpans = Callable[[str], Sequence[tuple[int, int, str, str]]]
"""What a mask replaces in a text: ``(start, end, placeholder, value)`` for each finding, in
text order (``value``: what the placeholder numbers; [`PIIMasker.mask_spans`][])."""

_NUMBERED = re.compile(r"<([A-Z][A-Z0-9_]*)_([0-9]+)>")


def _spans_between(
    spans: Sequence[tuple[int, int, str, str]], start: int, end: int
) -> list[tuple[int, int, str, str]] | None:
    """The spans that end after ``start`` and start before ``end``; None if one runs on past
    ``end``."""
    found = [span for span in spans if span[1] > start and span[0] < end]
    if found and found[-1][1] > end:
        return None
    return found


def _positions(spans: Sequence[tuple[int, int, str, str]]) -> list[tuple[int, int, str]]:
    """Where each finding stands and the value it numbers (its number aside)."""
    return [(start, end, value) for start, end, _placeholder, value in spans]


_WHITESPACE = " \t\n\r"
_TRAILING_RUN = re.compile(r"[0-9A-Z+()\-./: ]*\Z")
"""The run at a word's end of the characters the built-in findings that may hold whitespace
(IBAN, card, phone) are made of, as the detectors read them (`fold`): a fullwidth digit or a
no-break space between groups is one of these too."""
_STARTS_ONE = re.compile(r"(?<![0-9A-Za-z])[0-9A-Z(+]")
"""Where such a finding may start: at a digit, a capital, "(" or "+", never right after a
letter or a digit (it would continue a word, a number or a code)."""


def _ends_a_finding_never_crosses(folded: str) -> bool:
    """Whether no whitespace-spanning finding can run on past the end of a word (``folded``:
    as the detectors read it, `fold`).

    Such a finding holds the end of the word as the detectors read it, back to where
    it starts: so it cannot when the word ends in a character none holds ("Hello,"), or in a
    run of characters they may hold after one they do not, none of which can start one
    ("confirmed.", "mp3"). A run one can start in may: a card's first group in quotes
    (``"4111``) or after an escaped space (``card\\u00204111`` reads "card 4111"); so may a
    word made of such characters only (a group after another)."""
    run = _TRAILING_RUN.search(folded)
    start = len(folded) if run is None else run.start()
    return start > 0 and _STARTS_ONE.search(folded, start) is None


def _last_safe_word_end(folded: str, floor: int) -> int:
    """The end of the last word after ``floor`` followed by whitespace that no
    whitespace-spanning finding can run on past (0: none), in the text as the detectors read
    it (``folded``)."""
    text = folded
    end = len(text)
    while end > floor:
        space = max(text.rfind(char, floor, end) for char in _WHITESPACE)
        if space <= floor:
            return 0
        start = max(text.rfind(char, floor, space) for char in _WHITESPACE) + 1
        word = text[start:space]
        if word and _ends_a_finding_never_crosses(word):
            return space
        end = space
    return 0


_OPEN_PLACEHOLDER = re.compile(r"<(?:[A-Z][A-Z0-9_]*)?\Z")
"""The end of a text that more text may still turn into a placeholder (``<``, ``<EMAIL_1``)."""


class RevealStream:
    """Reveals placeholders in a text received in pieces; see the module docstring.

    Args:
        reveal: the text with its placeholders replaced (a [`UserVault`][]'s
            ``reveal``); called on whole placeholders only.
        max_held_chars: an unfinished ``<...`` longer than this is not one of keel's
            placeholders (their entity names are short): it is released as written.
    """

    def __init__(self, reveal: Callable[[str], str], *, max_held_chars: int = 64) -> None:
        if max_held_chars < 12:
            raise ValueError("max_held_chars must leave room for a placeholder (>= 12)")
        self._reveal = reveal
        self.max_held_chars = max_held_chars
        self._held = ""
        self._strings = JsonStrings()

    def feed(self, piece: str) -> str:
        """Take ``piece``; return the revealed text that can be shown now ('' when none)."""
        text = self._held + piece
        opened = _OPEN_PLACEHOLDER.search(text, max(0, len(text) - self.max_held_chars))
        cut = len(text) if opened is None else opened.start()
        self._held = text[cut:]
        return self._revealed(text[:cut]) if cut else ""

    def finish(self) -> str:
        """Everything held back, revealed (the stream ended)."""
        held, self._held = self._held, ""
        return self._revealed(held) if held else ""

    def _revealed(self, text: str) -> str:
        """``text`` revealed; in a streamed JSON text, a placeholder inside a string alone and
        its value escaped, as [`UserVault.reveal`][keel.privacy.UserVault.reveal] shows the
        text whole."""
        strings = self._strings.spans(text)
        placed = [match for match in PLACEHOLDER.finditer(text) if inside(strings, match.start())]
        if not placed:
            return self._reveal(text)
        pieces: list[str] = []
        start = 0
        for match in placed:
            pieces.append(
                self._reveal(text[start : match.start()]) if start < match.start() else ""
            )
            value = self._reveal(match.group(0))
            pieces.append(value if value == match.group(0) else json_escaped(value))
            start = match.end()
        pieces.append(self._reveal(text[start:]) if start < len(text) else "")
        return "".join(pieces)
