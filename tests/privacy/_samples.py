"""PII samples for the tests that look for raw values in what keel persisted, and a dump of
every table of a SQLite file to look in.

Each set holds one value of every kind the masker must catch. The values are whole, distinctive
strings (never a fragment such as "4111", which a random id can contain), and the sets differ so
a leak says where it came from: the user's text, a tool's output, or the model's output.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

__all__ = [
    "MODEL_PII",
    "TOOL_PII",
    "USER_PII",
    "dump_sqlite",
    "fed_in_pieces",
    "leaks",
    "sentence",
]

USER_PII = {
    "EMAIL": "mallory.x7q@example.org",
    "CREDIT_CARD": "4111 1111 1111 1111",
    "API_KEY": "sk-proj-Q7wErTy8uIoP9aSdFgHj0kLzXcVb",
    "IBAN": "GB82 WEST 1234 5698 7654 32",
    "PHONE": "+1 415 555 0132",
    "US_SSN": "536-22-1234",
}
TOOL_PII = {
    "EMAIL": "trent.k4v@example.net",
    "CREDIT_CARD": "5500 0000 0000 0004",
    "API_KEY": "sk-live-Zx9Cv8Bn7Mq6Wr5Ty4Ui3Op2",
    "IBAN": "DE89370400440532013000",
    "PHONE": "(415) 555-0198",
    "US_SSN": "078-05-1120",
}
MODEL_PII = {
    "EMAIL": "peggy.w2j@example.com",
    "CREDIT_CARD": "4012 8888 8888 1881",
    "API_KEY": "sk-ant-Hk3Lm9Np2Qr7St4Vw8Xy1Za6B",
    "IBAN": "NL91ABNA0417164300",
    "PHONE": "+44 20 7946 0958",
    "US_SSN": "219-09-9999",
}


def sentence(values: dict[str, str]) -> str:
    """One sentence that carries every value of a set."""
    return (
        f"write to {values['EMAIL']}, charge card {values['CREDIT_CARD']}, use the key "
        f"{values['API_KEY']}, wire to {values['IBAN']}, call {values['PHONE']}, "
        f"SSN {values['US_SSN']}"
    )


def _raw_forms(value: str) -> set[str]:
    # A card or an IBAN stored without its spaces is the same leak.
    return {value, value.replace(" ", "")}


def dump_sqlite(path: Path) -> dict[str, str]:
    """Every row of every table of the file (found in sqlite_master, so new tables are
    covered), as text per table; blobs are decoded byte for byte."""
    conn = sqlite3.connect(path)
    try:
        names = [
            str(row[0])
            for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
        ]
        dumped: dict[str, str] = {}
        for name in names:
            cursor = conn.execute(f'SELECT * FROM "{name}"')
            columns = [str(column[0]) for column in cursor.description]
            lines: list[str] = []
            for row in cursor:
                cells = []
                for column, value in zip(columns, row, strict=True):
                    text = value.decode("latin-1") if isinstance(value, bytes) else str(value)
                    cells.append(f"{column}={text}")
                lines.append(" | ".join(cells))
            dumped[name] = "\n".join(lines)
    finally:
        conn.close()
    return dumped


def leaks(
    dumped: dict[str, str],
    *sets: dict[str, str],
    forms: Callable[[str], set[str]] = _raw_forms,
) -> list[str]:
    """``'KIND form in table'`` for every form of a value (``forms``: the ways it could be
    written, raw by default) found in the dump."""
    found: list[str] = []
    for values in sets:
        for kind, value in values.items():
            for form in forms(value):
                found.extend(
                    f"{kind} {form!r} in {table}" for table, text in dumped.items() if form in text
                )
    return found


class _Stream(Protocol):
    def feed(self, piece: str) -> str: ...

    def finish(self) -> str: ...


def fed_in_pieces(stream: _Stream, text: str, cuts: Sequence[int]) -> str:
    """What ``stream`` (a `StreamMasker` or a `RevealStream`) shows of ``text`` fed in pieces
    of the sizes ``cuts`` gives, cycling, then finished."""
    shown, position, turn = "", 0, 0
    while position < len(text):
        size = cuts[turn % len(cuts)]
        turn += 1
        shown += stream.feed(text[position : position + size])
        position += size
    return shown + stream.finish()
