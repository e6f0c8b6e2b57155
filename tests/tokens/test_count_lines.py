"""A block of recalled memories counted line by line: exact, and only its new lines tokenized.

Consecutive turns recall mostly the same records, in other blocks and orders; the packed text
and the prompt's memories block are new texts each turn, but their lines are not. Where the
encoding starts a new pre-token after a newline anyway, the count of the whole is the sum of
its pieces' counts, each kept: what one such count tokenizes is the lines it has not met.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from keel.tokens import ChatTokenCounter, counter_for
from keel.tokens._chat import newline_pieces
from keel.tokens._openai import EstimatingTokenizer, openai_encoding

# Characters around line breaks that pre-tokenizers treat differently: punctuation that takes
# the newlines after it (and a slash after those), spaces and Unicode spaces before and after
# a break, CRLF, digits, contractions, letters outside Latin-1.
_PARTS = [
    "a", "Zeta", "é", "7", "12345", "[", "-", "/", ".", ",", "!", "'s", "'", "\n", "\n\n",
    "\r\n", " ", "  ", "\t", "·", "—", "日本", "\u00a0", "\u2028", "😀", "x/y", "-->",
    "[episodic · 2026-12-07 · inferred]", "User: ", "’",
]  # fmt: skip


def _texts(seed: int, count: int) -> list[str]:
    draw = random.Random(seed)
    return ["".join(draw.choice(_PARTS) for _ in range(draw.randint(1, 40))) for _ in range(count)]


@pytest.mark.parametrize("encoding", ["o200k_base", "cl100k_base"])
def test_the_pieces_of_a_text_count_as_the_text_whole(encoding: str) -> None:
    tokenizer = openai_encoding(encoding)
    assert tokenizer.splits_after_newlines
    for text in _texts(47, 4000):
        pieces = newline_pieces(text)
        assert "".join(pieces) == text
        assert sum(tokenizer.count(piece) for piece in pieces) == tokenizer.count(text), text


def _recording(real: Any) -> tuple[ChatTokenCounter, list[str]]:
    """A counter of its own over gpt-4o's profile, recording every text its tokenizer gets."""
    tokenized: list[str] = []

    class Recording:
        exact = True
        splits_after_newlines = getattr(real, "splits_after_newlines", False)

        def count(self, text: str) -> int:
            tokenized.append(text)
            return int(real.count(text))

    return ChatTokenCounter(counter_for("gpt-4o").profile, Recording()), tokenized  # type: ignore[arg-type]


def _block(records: list[str]) -> str:
    label = "[episodic · 2026-12-07 · inferred]"
    return "Relevant memories:\n" + "\n".join(f"- {label}\n{r}" for r in records)


def test_a_block_that_repeats_recalled_lines_tokenizes_only_its_new_line() -> None:
    real = counter_for("gpt-4o").tokenizer
    counter, tokenized = _recording(real)
    records = [f"User: what do the records say about item {n}?" for n in range(8)]
    first = _block(records)
    assert counter.count_lines(first) == real.count(first)
    # The next turn: two records left, one new among the rest, in another order.
    again = _block([records[5], "User: and item 99?", *records[6:1:-2], records[7]])
    tokenized.clear()
    assert counter.count_lines(again) == real.count(again)
    assert tokenized == ["User: and item 99?\n"]
    # The same block once more is one look-up.
    tokenized.clear()
    assert counter.count_lines(again) == real.count(again) and tokenized == []


def test_a_tokenizer_that_makes_no_such_promise_counts_the_text_whole() -> None:
    # An estimate rounds each count up: a sum of pieces would be more than the whole's.
    estimate = EstimatingTokenizer(openai_encoding("o200k_base"))
    counter, tokenized = _recording(estimate)
    text = _block(["User: a", "User: b"])
    assert counter.count_lines(text) == estimate.count(text)
    assert tokenized == [text]
