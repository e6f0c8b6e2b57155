"""What the context engine exchanges with long-term memory: ranked items in, archives out."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

from keel.messages import Message

__all__ = ["ContextMemory", "MemorySink"]


class ContextMemory(BaseModel):
    """One retrieved memory offered to the prompt compiler.

    Memories are ranked by ``score`` (highest first; items without a score rank by their
    position, after scored ones keep their relative order). When memories must give way, the
    lowest-ranked go first.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    text: str = Field(description="The memory as it should appear in the prompt.")
    score: float | None = Field(
        default=None, description="Relevance; higher ranks first. None: keep the given order."
    )
    id: str | None = Field(default=None, description="The memory's id, echoed in reports.")


@runtime_checkable
class MemorySink(Protocol):
    """Where evicted turns and committed summaries go: long-term memory plugs in here.

    ``archive`` is awaited before a summary is committed; if it raises, the summary is not
    committed and the turns stay in the conversation, so nothing is lost when memory is down.
    It must be idempotent per (session, messages): a retried summary archives the same turns
    again.
    """

    async def archive(self, session_id: str, evicted: Sequence[Message], summary: str) -> None:
        """Keep ``evicted`` (whole turns, oldest first) and the new running ``summary``."""
        ...
