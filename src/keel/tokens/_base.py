"""The tokenizer interface and the token-count record every counter returns."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["ExactTokenizer", "TokenCount", "Tokenizer"]


@runtime_checkable
class Tokenizer(Protocol):
    """Counts tokens of text for one encoding.

    ``exact`` is True when counts equal what the model itself sees; an estimating tokenizer
    sets it to False and pads its counts by a safety factor so budgets stay conservative.
    """

    @property
    def name(self) -> str:
        """The encoding's name (``o200k_base``, ``gguf:smollm2``, ...)."""
        ...

    @property
    def exact(self) -> bool:
        """Whether counts are exact for the target model."""
        ...

    def count(self, text: str) -> int:
        """Number of tokens in ``text``."""
        ...

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (for an estimating tokenizer: the base encoding's ids)."""
        ...

    def decode(self, tokens: list[int]) -> str:
        """Text of ``tokens``."""
        ...


class ExactTokenizer:
    """What every tokenizer whose counts are the model's own shares: its name, and ``exact``."""

    def __init__(self, name: str) -> None:
        self._name = name

    @property
    def name(self) -> str:
        return self._name

    @property
    def exact(self) -> bool:
        return True


class TokenCount(BaseModel):
    """A token count and how much to trust it."""

    model_config = ConfigDict(frozen=True)

    model: str = Field(description="The model the count is for.")
    encoding: str = Field(description="The encoding used to count.")
    tokens: int = Field(ge=0, description="The number of tokens.")
    exact: bool = Field(description="True when the count is exact, False for an estimate.")
