"""How the detectors read a text: folded (`fold`) and, where it holds JSON string escapes,
decoded (`fold_readings`), with a map back to the text as written (`FoldMap`).

Fullwidth forms, digits of other scripts, Unicode spaces and dashes become their ASCII
equivalents one character for one, and invisible format characters (Unicode category Cf) are
left out, so a value written with them is found like any other and the span replaced is the
original one. See `keel.privacy._detectors` for what is found in the folded text.
"""

from __future__ import annotations

import re
import unicodedata
from bisect import bisect_left, bisect_right
from dataclasses import dataclass

__all__ = ["FoldMap", "fold", "fold_map", "fold_readings"]


_UNICODE_SPACES = "\u00a0\u1680\u202f\u205f\u3000" + "".join(map(chr, range(0x2000, 0x200B)))
# The dashes found between digit groups (hyphen, non-breaking hyphen, figure dash, minus, small
# hyphen-minus); not the en and em dashes of prose (year ranges, asides).
_UNICODE_DASHES = "\u2010\u2011\u2012\u2212\ufe63"
# Unicode's format characters (category Cf, as of Unicode 15, and the Egyptian format controls
# Unicode 15 adds after them): invisible, so a value written with one inside (pasted, or put
# there to slip past the masker) reads as the value. tests/privacy/test_masker_invisible.py
# checks that this covers every Cf character of the running Python's Unicode database. Read as
# absent too: a lone surrogate (category Cs: half a character, which a Python string or a JSON
# escape can hold) and U+FFFD, the replacement character a lone surrogate becomes before it is
# stored (`storable`) and an undecodable byte becomes when read: neither is part of a value, so
# "4111 1111\ufffd 1111 1111" reads as the card a person reading it sees.
_FORMAT_CHARS = (
    "\ud800-\udfff\ufffd\u00ad\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891\u08e2\u180e\u200b-\u200f"
    "\u202a-\u202e\u2060-\u2064\u2066-\u206f\ufeff\ufff9-\ufffb\U000110bd\U000110cd"
    "\U00013430-\U0001343f\U0001bca0-\U0001bca3\U0001d173-\U0001d17a\U000e0001"
    "\U000e0020-\U000e007f"
)
_FORMAT = re.compile(f"[{_FORMAT_CHARS}]+")
_FOLD_CACHE_LIMIT = 1 << 16


class _FoldTable(dict[int, int | str | None]):
    """``str.translate``'s table, filled on first sight of each character: a digit of any script
    becomes its ASCII digit, a fullwidth form its ASCII character, a Unicode space or dash an
    ASCII one, a format character nothing; anything else stays. One character for one, except
    the format characters: where one is left out, `_kept_positions` maps positions back."""

    def __missing__(self, code: int) -> int | str | None:
        char = chr(code)
        folded: int | str | None = code
        if _FORMAT.match(char):
            folded = None
        elif 0xFF01 <= code <= 0xFF5E:
            folded = chr(code - 0xFEE0)
        elif char in _UNICODE_SPACES:
            folded = " "
        elif char in _UNICODE_DASHES:
            folded = "-"
        else:
            digit = unicodedata.decimal(char, None)
            if digit is not None:
                folded = str(digit)
        if len(self) < _FOLD_CACHE_LIMIT:
            self[code] = folded
        return folded


_FOLD_TABLE = _FoldTable()
# A character ``fold`` changes: non-ASCII, then (checked only there) a digit, a fullwidth form,
# a Unicode space or dash. Most non-ASCII text (accents, other scripts) has none and is left as
# it is without a pass over each character in Python's mapping.
_FOLDABLE = re.compile(
    rf"[^\x00-\x7f](?<=[\d\uff01-\uff5e{_UNICODE_SPACES}{_UNICODE_DASHES}{_FORMAT_CHARS}])"
)


# JSON's string escapes, read left to right as a JSON parser reads them: a backslash escaped
# (two in the text, then "u00f6") is one escape, and the "u00f6" after it is text. A surrogate
# pair is one escape of one character; a lone surrogate stands for itself (as json.loads reads
# it). Nothing else after a backslash is an escape: it is read as written.
_JSON_ESCAPE = re.compile(
    r"(\\(?:u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|[\"\\/bfnrt]))"
)
"""One group: ``split`` gives the text between the escapes and the escapes, in C."""


class _EscapeTable(dict[str, str]):
    """Each escape's character, found on first sight (bounded as the fold table is)."""

    def __missing__(self, escape: str) -> str:
        if len(escape) == 12:
            high, low = int(escape[2:6], 16), int(escape[8:], 16)
            char = chr(0x10000 + ((high - 0xD800) << 10) + (low - 0xDC00))
        else:
            char = chr(int(escape[2:], 16))
        if len(self) < _FOLD_CACHE_LIMIT:
            self[escape] = char
        return char


_ESCAPE_TABLE = _EscapeTable(
    {
        '\\"': '"',
        "\\\\": "\\",
        "\\/": "/",
        "\\b": "\b",
        "\\f": "\f",
        "\\n": "\n",
        "\\r": "\r",
        "\\t": "\t",
    }
)


class _Escapes:
    """A text with its JSON escapes decoded (``decoded``), and where each one stood: its
    character's position in the decoded text (``decoded_at``, ascending) and its original span
    (``starts``, ``ends``), worked out when first asked (most texts hold no finding)."""

    __slots__ = ("_parts", "decoded", "decoded_at", "ends", "other", "starts")

    def __init__(self, decoded: str, parts: list[str]) -> None:
        self.decoded = decoded
        self._parts = parts  # text, escape, text, escape, ..., text (as written)
        self.other: _Escapes | None = None  # the other reading of an ambiguous text
        self.decoded_at: list[int] = []
        self.starts: list[int] = []
        self.ends: list[int] = []

    def escapes(self) -> list[str]:
        """The escapes as written, in text order."""
        return self._parts[1::2]

    def _locate(self) -> None:
        if self.starts:
            return
        position = decoded = 0
        parts = self._parts
        for index in range(1, len(parts), 2):
            before = len(parts[index - 1])
            position += before
            decoded += before
            self.decoded_at.append(decoded)
            self.starts.append(position)
            position += len(parts[index])
            self.ends.append(position)
            decoded += 1

    def start(self, at: int) -> int:
        """Where decoded character ``at`` starts in the original."""
        self._locate()
        escape = bisect_right(self.decoded_at, at) - 1
        if escape < 0:
            return at
        if self.decoded_at[escape] == at:
            return self.starts[escape]
        return self.ends[escape] + at - self.decoded_at[escape] - 1

    def end(self, at: int) -> int:
        """Where decoded character ``at`` ends in the original."""
        self._locate()
        escape = bisect_right(self.decoded_at, at) - 1
        if escape >= 0 and self.decoded_at[escape] == at:
            return self.ends[escape]
        return self.start(at) + 1

    def count_before(self, position: int) -> int:
        """How many decoded characters start before original ``position``."""
        self._locate()
        escape = bisect_left(self.starts, position) - 1
        if escape < 0:
            return position
        if self.ends[escape] > position:  # inside that escape
            return self.decoded_at[escape] + 1
        return position - (self.ends[escape] - self.decoded_at[escape] - 1)


# Left in a text once decoded, a ``\\uXXXX`` or an escaped backslash is the sign of JSON
# encoded twice (a JSON text held in a JSON string); a short escape is not: a Windows path
# written once as JSON reads ``C:\\nina`` once decoded, which is no line break, and JSON
# encoded twice holding no ``\\uXXXX`` reads ``card\\n4111...``, which is one. The text is
# then read both ways (`_Escapes.other`).
_ESCAPED_TWICE = re.compile(r"\\(?:u[0-9a-fA-F]{4}|\\)")
# Any other escape left once decoded: the text may be JSON encoded twice, or not.
_SHORT_ESCAPE = re.compile(r'\\["/bfnrt]')


class _TwiceEscaped(_Escapes):
    """JSON decoded twice (or more): ``outer`` maps the once-decoded text to the original,
    ``inner`` the text decoded again (``decoded``) to the once-decoded; each position goes
    through both, so a character's span is the whole of its escape escaped again
    (``\\\\u00f6``)."""

    __slots__ = ("inner", "outer")

    def __init__(self, outer: _Escapes, inner: _Escapes) -> None:
        super().__init__(inner.decoded, [])
        self.outer = outer
        self.inner = inner

    def start(self, at: int) -> int:
        return self.outer.start(self.inner.start(at))

    def end(self, at: int) -> int:
        return self.outer.end(self.inner.end(at) - 1)

    def count_before(self, position: int) -> int:
        return self.inner.count_before(self.outer.count_before(position))


def _unescaped(text: str) -> _Escapes | None:
    """``text`` with its JSON string escapes decoded, and where they stood; None if it holds
    none (the caller looks for a backslash first: most texts have none). Decoded twice where
    the once-decoded text still holds a ``\\uXXXX`` or an escaped backslash: a JSON text held
    in a JSON string (a tool's JSON output in a result keel writes as JSON, an MCP server's
    JSON text wrapped again) hides its values behind two levels of escapes. Where it still
    holds only short escapes, the reading returned has the other one as ``other``."""
    escapes = _unescaped_once(text)
    if escapes is None or "\\" not in escapes.decoded:
        return escapes
    decoded = escapes.decoded
    if _ESCAPED_TWICE.search(decoded) is not None:
        # Each level is shorter than the one it is decoded from: a JSON text wrapped three
        # times is decoded three times, and the passes end.
        inner = _unescaped(decoded)
        return escapes if inner is None else _TwiceEscaped(escapes, inner)
    if _SHORT_ESCAPE.search(decoded) is None:
        return escapes
    # Only short escapes left (``\\n``, ``\\"``): a JSON text in a JSON string that holds no
    # ``\\uXXXX`` (its line breaks and quotes escaped twice), or a backslash written once
    # before a letter (``C:\\nina``). Both readings are kept: the detectors read each, so a
    # card after an escaped line break escaped again is not read as glued to an "n". The
    # text's own quotes escaped (``{\\"note\\": ...}``) say which comes first, whose spans win.
    inner = _unescaped(decoded)
    if inner is None:
        return escapes
    twice = _TwiceEscaped(escapes, inner)
    if '\\"' in escapes.escapes():
        twice.other = escapes
        return twice
    escapes.other = twice
    return escapes


def _unescaped_once(text: str) -> _Escapes | None:
    """One level of ``text``'s JSON escapes decoded, or None. Split in C, each escape looked
    up in a table: no Python call per escape (a JSON document written with ASCII escapes
    holds thousands)."""
    parts = _JSON_ESCAPE.split(text)
    if len(parts) == 1:
        return None
    decoded = parts.copy()
    table = _ESCAPE_TABLE
    decoded[1::2] = [table[escape] for escape in parts[1::2]]
    return _Escapes("".join(decoded), parts)


def _folded_chars(text: str) -> str:
    """``text`` folded character for character (format characters left out); no escapes."""
    if text.isascii() or _FOLDABLE.search(text) is None:
        return text
    return text.translate(_FOLD_TABLE)


def fold(text: str) -> str:
    """``text`` as the detectors read it: its JSON string escapes decoded (``\\u00f6``,
    ``\\n``, ``\\/``...), fullwidth forms, digits of every script, Unicode spaces and dashes as
    their ASCII equivalents, character for character, and its format characters left out
    (then shorter: `fold_map` gives each folded character's span in ``text``)."""
    if "\\" in text:
        escapes = _unescaped(text)
        if escapes is not None:
            text = escapes.decoded
    return _folded_chars(text)


@dataclass(frozen=True)
class FoldMap:
    """Where each character of ``fold(text)`` stands in ``text``: a decoded escape spans the
    whole escape, any other character itself (format characters left out belong to no
    folded character)."""

    escapes: _Escapes | None
    kept: list[int] | None
    """The position in the decoded text of each folded character (None: all of them)."""

    def span(self, start: int, end: int) -> tuple[int, int]:
        """The original span of folded characters ``start`` to ``end`` (``end > start``)."""
        first, last = start, end - 1
        if self.kept is not None:
            first, last = self.kept[first], self.kept[last]
        if self.escapes is None:
            return first, last + 1
        return self.escapes.start(first), self.escapes.end(last)

    def index(self, position: int) -> int:
        """How many folded characters start before original ``position``."""
        decoded = position if self.escapes is None else self.escapes.count_before(position)
        return decoded if self.kept is None else bisect_left(self.kept, decoded)


def fold_map(text: str) -> tuple[str, FoldMap | None]:
    """``fold(text)`` and where its characters stand in ``text`` (None: each where it is)."""
    return _reading(text, _unescaped(text) if "\\" in text else None)


def fold_readings(text: str) -> list[tuple[str, FoldMap | None]]:
    """`fold_map`'s reading of ``text``, then, where its escapes read two ways (short escapes
    left once decoded: JSON encoded twice, or a backslash before a letter), the other one."""
    escapes = _unescaped(text) if "\\" in text else None
    readings = [_reading(text, escapes)]
    if escapes is not None and escapes.other is not None:
        readings.append(_reading(text, escapes.other))
    return readings


def _reading(text: str, escapes: _Escapes | None) -> tuple[str, FoldMap | None]:
    decoded = text if escapes is None else escapes.decoded
    folded = _folded_chars(decoded)
    kept = _kept_positions(decoded) if len(folded) != len(decoded) else None
    if escapes is None and kept is None:
        return folded, None
    return folded, FoldMap(escapes, kept)


def _kept_positions(text: str) -> list[int]:
    """The position in ``text`` of each character of ``_folded_chars(text)`` (those not left
    out)."""
    kept: list[int] = []
    start = 0
    for run in _FORMAT.finditer(text):
        kept.extend(range(start, run.start()))
        start = run.end()
    kept.extend(range(start, len(text)))
    return kept
