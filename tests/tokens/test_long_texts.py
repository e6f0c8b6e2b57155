"""Texts longer than bpe-openai accepts in one call are counted exactly, in pieces."""

from __future__ import annotations

from keel.tokens import counter_for
from keel.tokens._openai import _MAX_PIECE_CHARS, _pieces


def test_a_text_over_a_million_characters_is_counted_exactly() -> None:
    tokenizer = counter_for("gpt-4o").tokenizer
    unit = "Order 12 shipped, total: 3.50 EUR.\nThe customer's seat is 4B. "
    text = unit * (1_100_000 // len(unit) + 1)
    pieces = _pieces(text)
    assert len(pieces) > 2 and all(safe for _, safe in pieces)
    assert "".join(piece for piece, _ in pieces) == text
    assert all(len(piece) <= _MAX_PIECE_CHARS for piece, _ in pieces)
    # The unit's count is linear in its repetitions, so the exact count of the whole is known.
    units = len(text) // len(unit)
    one_thousand = tokenizer.count(unit * 1_000)
    per_unit = (tokenizer.count(unit * 2_000) - one_thousand) // 1_000
    assert tokenizer.count(text) == one_thousand + (units - 1_000) * per_unit
    assert len(tokenizer.encode(text)) == tokenizer.count(text)


def test_a_text_without_safe_cut_points_is_never_undercounted() -> None:
    tokenizer = counter_for("gpt-4o").tokenizer
    text = "x" * 900_000
    count = tokenizer.count(text)
    assert count >= sum(tokenizer.count(piece) for piece, _ in _pieces(text))
