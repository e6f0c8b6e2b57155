"""Packing retrieved memories into an exact token budget, each item labelled."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from keel.memory._records import MemoryRecord
from keel.tokens import ChatTokenCounter

__all__ = ["PackedItem", "PackedMemory", "label_for", "pack_items"]


def label_for(record: MemoryRecord) -> str:
    """``[semantic · 2024-05-07 · verified]``: kind, date and provenance of a record."""
    return f"[{record.kind} · {record.when.date().isoformat()} · {record.provenance}]"


class PackedItem(BaseModel):
    """One labelled block of the packed memory text."""

    model_config = ConfigDict(frozen=True)

    section: str = Field(description="profile, relevant, recent or examples.")
    text: str = Field(description="The labelled block as it appears in the prompt.")
    tokens: int = Field(description="Exact tokens of ``text`` for the counting model.")
    record_ids: tuple[str, ...] = Field(description="Records the block shows (neighbours too).")
    score: float = Field(default=0.0, description="The retrieval score that ranked it.")


class PackedMemory(BaseModel):
    """Memories chosen for a prompt, within a token budget, highest value first."""

    model_config = ConfigDict(frozen=True)

    items: tuple[PackedItem, ...] = Field(description="The blocks, in prompt order.")
    text: str = Field(description="The blocks joined with blank lines ('' if none).")
    tokens: int = Field(description="Exact tokens of ``text``; never above ``budget``.")
    budget: int = Field(description="The budget it was packed into.")
    dropped: int = Field(default=0, description="Candidate blocks that did not fit.")

    @property
    def record_ids(self) -> tuple[str, ...]:
        """Every record shown, in order, without repeats."""
        return tuple(dict.fromkeys(rid for item in self.items for rid in item.record_ids))


def pack_items(
    candidates: Sequence[tuple[str, str, tuple[str, ...], float]],
    budget: int,
    counter: ChatTokenCounter,
) -> PackedMemory:
    """Greedy packing in the given (value) order: a block that does not fit is skipped and
    smaller later blocks may still fit. The joined text is re-counted exactly, so the result
    is within ``budget`` even where tokens merge across the separators (line by line where
    the tokenizer allows it: the blocks recalled turn after turn share their lines).

    ``candidates`` are ``(section, text, record_ids, score)`` tuples.
    """
    separator_tokens = counter.count_text("\n\n")
    chosen: list[PackedItem] = []
    used = 0
    dropped = 0
    seen: set[str] = set()
    for section, text, record_ids, score in candidates:
        if record_ids and set(record_ids) <= seen:
            continue
        tokens = counter.count_lines(text)
        extra = tokens + (separator_tokens if chosen else 0)
        if used + extra > budget:
            dropped += 1
            continue
        chosen.append(
            PackedItem(
                section=section, text=text, tokens=tokens, record_ids=record_ids, score=score
            )
        )
        seen.update(record_ids)
        used += extra
    text = "\n\n".join(item.text for item in chosen)
    total = counter.count_lines(text) if text else 0
    while chosen and total > budget:
        chosen.pop()
        dropped += 1
        text = "\n\n".join(item.text for item in chosen)
        total = counter.count_lines(text) if text else 0
    return PackedMemory(
        items=tuple(chosen), text=text, tokens=total, budget=budget, dropped=dropped
    )
