"""A forgiving reader for the almost-JSON that small models write.

It accepts what strict JSON rejects but a human would read without doubt: single-quoted
strings, trailing commas, unquoted keys, Python literals (``True``, ``None``), ``//`` comments
and smart quotes. It still refuses anything ambiguous (an unclosed object, a missing value),
raising `LenientJSONError` with the position, so a truncated reply is never taken for a
complete one.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["LenientJSONError", "find_json_end", "loads"]

_LITERALS: dict[str, Any] = {
    "true": True,
    "false": False,
    "null": None,
    "True": True,
    "False": False,
    "None": None,
}
_SMART_QUOTES = str.maketrans({"\u201c": '"', "\u201d": '"', "\u2018": "'", "\u2019": "'"})
_ESCAPES = {'"': '"', "'": "'", "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r"}
_ESCAPES["t"] = "\t"


class LenientJSONError(ValueError):
    """The text is not JSON even when read leniently; ``unclosed`` marks a cut-off text."""

    def __init__(self, message: str, position: int, *, unclosed: bool = False) -> None:
        self.position = position
        self.unclosed = unclosed
        super().__init__(f"{message} at character {position}")


class _Reader:
    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def fail(self, message: str, *, unclosed: bool = False) -> LenientJSONError:
        return LenientJSONError(message, self.pos, unclosed=unclosed)

    def skip_space(self) -> None:
        text = self.text
        while self.pos < len(text):
            char = text[self.pos]
            if char.isspace():
                self.pos += 1
            elif text.startswith("//", self.pos) or char == "#":
                newline = text.find("\n", self.pos)
                self.pos = len(text) if newline < 0 else newline + 1
            elif text.startswith("/*", self.pos):
                end = text.find("*/", self.pos + 2)
                self.pos = len(text) if end < 0 else end + 2
            else:
                return

    def peek(self) -> str:
        self.skip_space()
        if self.pos >= len(self.text):
            raise self.fail("unexpected end of text", unclosed=True)
        return self.text[self.pos]

    def value(self) -> Any:
        char = self.peek()
        if char == "{":
            return self.obj()
        if char == "[":
            return self.array()
        if char in "\"'":
            return self.string()
        if char in "-+.0123456789":
            return self.number()
        word = self.word()
        if word in _LITERALS:
            return _LITERALS[word]
        if not word:
            raise self.fail(f"unexpected character {char!r}")
        raise self.fail(f"unknown literal {word!r}")

    def word(self) -> str:
        start = self.pos
        while self.pos < len(self.text) and (
            self.text[self.pos].isalnum() or self.text[self.pos] in "_$-"
        ):
            self.pos += 1
        return self.text[start : self.pos]

    def obj(self) -> dict[str, Any]:
        self.pos += 1
        result: dict[str, Any] = {}
        while True:
            char = self.peek()
            if char == "}":
                self.pos += 1
                return result
            if char in "\"'":
                key = self.string()
            else:
                key = self.word()
                if not key:
                    raise self.fail(f"expected a key, found {char!r}")
            if self.peek() != ":":
                raise self.fail(f"expected ':' after key {key!r}")
            self.pos += 1
            result[key] = self.value()
            char = self.peek()
            if char == ",":
                self.pos += 1
            elif char != "}":
                raise self.fail(f"expected ',' or '}}', found {char!r}")

    def array(self) -> list[Any]:
        self.pos += 1
        result: list[Any] = []
        while True:
            char = self.peek()
            if char == "]":
                self.pos += 1
                return result
            result.append(self.value())
            char = self.peek()
            if char == ",":
                self.pos += 1
            elif char != "]":
                raise self.fail(f"expected ',' or ']', found {char!r}")

    def string(self) -> str:
        quote = self.text[self.pos]
        self.pos += 1
        parts: list[str] = []
        text = self.text
        while self.pos < len(text):
            char = text[self.pos]
            if char == quote:
                self.pos += 1
                return "".join(parts)
            if char == "\\":
                escape = text[self.pos + 1 : self.pos + 2]
                if escape == "u":
                    digits = text[self.pos + 2 : self.pos + 6]
                    try:
                        parts.append(chr(int(digits, 16)))
                    except ValueError:
                        raise self.fail("invalid \\u escape") from None
                    self.pos += 6
                    continue
                if not escape:
                    break
                parts.append(_ESCAPES.get(escape, "\\" + escape))
                self.pos += 2
                continue
            parts.append(char)
            self.pos += 1
        raise self.fail("unterminated string", unclosed=True)

    def number(self) -> int | float:
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos] in "+-.0123456789eE":
            self.pos += 1
        token = self.text[start : self.pos]
        try:
            number = json.loads(token.lstrip("+"))
        except json.JSONDecodeError:
            try:
                return float(token)
            except ValueError:
                raise self.fail(f"invalid number {token!r}") from None
        if isinstance(number, int | float):
            return number
        raise self.fail(f"invalid number {token!r}")


def loads(text: str) -> Any:
    """Parse ``text`` strictly as JSON if possible, else leniently.

    Raises:
        LenientJSONError: the text is not readable as one JSON value (``unclosed`` set when it
            ends inside a string, object or array), or it has trailing content.
    """
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    reader = _Reader(text.translate(_SMART_QUOTES))
    value = reader.value()
    reader.skip_space()
    if reader.pos < len(reader.text):
        raise reader.fail("unexpected text after the value")
    return value


def find_json_end(text: str, start: int) -> int | None:
    """Index just past the bracket that closes the one at ``start``, or None if it never closes.

    Quotes of both kinds are honoured, so braces inside strings do not count.
    """
    opener = text[start]
    closer = {"{": "}", "[": "]"}[opener]
    depth = 0
    quote: str | None = None
    index = start
    while index < len(text):
        char = text[index]
        if quote is not None:
            if char == "\\":
                index += 2
                continue
            if char == quote:
                quote = None
        elif char in "\"'":
            # An apostrophe inside prose-like values ("don't") is not a quote: only treat it as
            # one where a string may begin (after a bracket, colon, comma or space).
            previous = text[index - 1] if index > start else opener
            if char == '"' or previous in "{[:, \n\t":
                quote = char
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return index + 1 if char == closer else None
        index += 1
    return None
