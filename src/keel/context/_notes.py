"""keel's own words in a conversation: runtime notes, marked as keel's.

When keel ends a turn itself (a model that kept failing, a limit, a bug), the user is told so in
keel's words (an apology). Those words are never the assistant's: kept in the history as an
assistant message, the next prompt would show the model an apology it never made, and a small
model repeats it word for word. The history keeps a short note instead, a system message that
says it is keel's; summaries and long-term memory leave it out (invariant 14).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from keel.messages import Message

__all__ = ["RUNTIME_NOTE", "is_runtime_note", "runtime_note"]

RUNTIME_NOTE = "keel_note"
"""The metadata key that marks a message as keel's own note (its value: why it was written)."""

_PREFIX = "[keel runtime note, not the assistant's words]"


def runtime_note(text: str, *, reason: str, metadata: Mapping[str, Any] | None = None) -> Message:
    """A note from keel for the model's context: a system message that says it is keel's
    (``metadata``: more entries for the message's metadata)."""
    return Message.system(f"{_PREFIX} {text}", metadata={**(metadata or {}), RUNTIME_NOTE: reason})


def is_runtime_note(message: Message) -> bool:
    """Whether ``message`` is keel's own note (never the user's or the model's words)."""
    return RUNTIME_NOTE in message.metadata
