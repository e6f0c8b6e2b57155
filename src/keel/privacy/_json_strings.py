"""Where a text read as JSON holds its strings, read whole or in pieces, so that a value the
vault reveals inside one is written as JSON writes it (a private key's line breaks as ``\\n``)
and a reply that is JSON stays JSON, streamed or not.

A text that opens, after white space, with ``{``, ``[`` or ``"`` is read as JSON: its strings
run from an unescaped quote to the next one, a backslash escaping the character after it (in
the next piece, when a piece ends on it). Any other text is read as prose, with no strings. The
rule is the same for a reply read whole and one read as it streams, so both show one text."""

from __future__ import annotations

import bisect
import json
import re

_OPENERS = frozenset('{["')
_QUOTE_OR_ESCAPE = re.compile(r'\\.|"', re.DOTALL)


class JsonStrings:
    """Reads a text in pieces (`spans`, one call a piece, in order) as JSON reads its
    strings."""

    def __init__(self) -> None:
        self._json: bool | None = None  # undecided until a piece holds more than white space
        self._inside = False
        self._escaping = False  # the last piece ended on a backslash inside a string

    def spans(self, piece: str) -> list[tuple[int, int]]:
        """The ranges of ``piece`` inside a string (a string still open at its end runs to its
        end); none for prose."""
        if self._json is None:
            opened = piece.lstrip()
            if not opened:
                return []
            self._json = opened[0] in _OPENERS
        if not self._json or not piece:
            return []
        found: list[tuple[int, int]] = []
        start = 0
        position = 0
        if self._escaping:
            self._escaping, position = False, 1
        end = position
        for match in _QUOTE_OR_ESCAPE.finditer(piece, position):
            end = match.end()
            if match.group() != '"':
                continue  # an escape: inside a string it is part of it
            if self._inside:
                found.append((start, match.start()))
            else:
                start = match.end()
            self._inside = not self._inside
        if self._inside:
            found.append((start, len(piece)))
            # A backslash left over at the end escapes the next piece's first character.
            self._escaping = piece.endswith("\\") and end < len(piece)
        return found


def inside(spans: list[tuple[int, int]], position: int) -> bool:
    """Whether ``position`` lies in one of ``spans`` (sorted, as `JsonStrings.spans` gives)."""
    at = bisect.bisect_right(spans, (position, float("inf"))) - 1
    return at >= 0 and spans[at][0] <= position < spans[at][1]


def json_escaped(value: str) -> str:
    """``value`` as it is written inside a JSON string."""
    return json.dumps(value, ensure_ascii=False)[1:-1]
