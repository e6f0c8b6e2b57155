"""What a turn checks and cleans of the caller's words, and the notes keel writes in its own
name: ids, the user's message, text that can be stored, the session's store key."""

from __future__ import annotations

import re
import unicodedata
from urllib.parse import quote

from keel.context import runtime_note
from keel.errors import UsageError
from keel.messages import Message
from keel.privacy import storable
from keel.state import AgentState

__all__ = [
    "cancelled_note",
    "clip",
    "is_user_turn",
    "open_turn_text",
    "require_id",
    "sanitize",
    "session_key",
    "unanswered_note",
    "user_text",
    "without_corrections",
]

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def session_key(tenant_id: str, session_id: str) -> str:
    """The store key of ``session_id`` in ``tenant_id``: ``tenant/session``, the tenant
    percent-encoded so that no tenant and session pair can spell another's key."""
    require_id("tenant_id", tenant_id)
    require_id("session_id", session_id)
    return f"{quote(tenant_id, safe='')}/{session_id}"


def require_id(name: str, value: object) -> None:
    if not isinstance(value, str):
        raise UsageError(f"{name} must be a string, got {type(value).__name__}")
    if not value.strip() or _LONE_SURROGATE.search(value) or not value.isprintable():
        raise UsageError(f"{name} must be non-empty printable text, got {value!r}")


def user_text(text: object) -> str:
    if not isinstance(text, str):
        raise UsageError(f"the user message must be a string, got {type(text).__name__}")
    visible = "".join(
        ch for ch in text if not ch.isspace() and unicodedata.category(ch) not in ("Cf", "Cc")
    )
    if not visible:
        raise UsageError("the user message is empty")
    if "\x00" in text:
        # PostgreSQL cannot store a NUL; SQLite could, so both refuse it before a turn starts.
        raise UsageError("the user message holds a NUL character (U+0000)")
    return text


def sanitize(text: str) -> str:
    """Text that can be stored: lone surrogates (legal in JSON, not in UTF-8) become U+FFFD
    (as the privacy view makes what it masks)."""
    return storable(text) if text else text


def is_user_turn(message: Message) -> bool:
    """A message the user wrote (runtime corrections travel as user messages too)."""
    return message.role == "user" and "keel_correction" not in message.metadata


def unanswered_note(status: str) -> Message:
    """What the history keeps of a turn keel ended without an answer: a note in keel's name.
    The user got keel's apology (the reply, the trace); the model is never shown it as its own
    answer, only that the turn got none."""
    return runtime_note(
        f"The turn above ended without an answer from the assistant ({status}); "
        "keel told the user so.",
        reason=status,
    )


def cancelled_note() -> Message:
    """What the history keeps of a turn its user cancelled (Ctrl-C in ``keel chat``): a note in
    keel's name, so the model knows the question above went unanswered on purpose and answers
    the next message, not the cancelled one."""
    return runtime_note(
        "[cancelled] The user cancelled the turn above before the assistant finished its "
        "answer; it stays unanswered unless they ask again.",
        reason="cancelled",
    )


def open_turn_text(state: AgentState) -> str | None:
    index = state.runtime.open_turn_message
    if index is None or index >= len(state.messages):
        return None
    return state.messages[index].content


def without_corrections(segment: list[Message]) -> list[Message]:
    """The turn's messages without the runtime's corrective prompts and the unusable replies
    they answered (or, for a request to continue, the part of the answer the final message
    holds whole): scaffolding of the run, not words of the user or answers of the agent."""
    kept: list[Message] = []
    for message in segment:
        if "keel_correction" in message.metadata:
            if kept and kept[-1].role == "assistant" and not kept[-1].tool_calls:
                kept.pop()
            continue
        kept.append(message)
    return kept


def clip(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"
