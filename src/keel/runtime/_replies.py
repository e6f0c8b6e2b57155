"""Replies kept for retries: a turn the caller gave its own id (an HTTP ``Idempotency-Key``)
runs once; its reply is committed with the turn, and a retry gets it back."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import TypeVar

from keel.errors import UsageError
from keel.runtime._reply import AgentReply
from keel.state import AgentState

__all__ = ["Recent", "recorded_reply", "request_digest", "with_reply"]

K = TypeVar("K")
V = TypeVar("V")

_REPLIES_KEPT = 16
"""Replies kept for turns that came with the caller's own turn id (retries come within minutes)."""


class Recent(OrderedDict[K, V]):
    """A dict that keeps its ``size`` most recently written (or moved) keys."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def __setitem__(self, key: K, value: V) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.size:
            self.popitem(last=False)


def request_digest(masked_text: str) -> str:
    """What identifies a turn's request for its retries: its (masked) message."""
    return hashlib.sha256(masked_text.encode()).hexdigest()


def recorded_reply(state: AgentState, turn_id: str, masked_text: str) -> AgentReply | None:
    """The reply committed for turn ``turn_id``, marked ``replayed``; None when none was.

    Raises:
        UsageError: the turn id was used for another message.
    """
    recorded = next((r for r in state.runtime.replies if r.get("turn_id") == turn_id), None)
    if recorded is None:
        return None
    if recorded.get("request") != request_digest(masked_text):
        raise UsageError(f"turn id {turn_id!r} was used for another message")
    replayed = AgentReply.model_validate(recorded["reply"])
    return replayed.model_copy(update={"replayed": True})


def with_reply(state: AgentState, turn_id: str, request: str, reply: AgentReply) -> AgentState:
    """``state`` with ``reply`` recorded for turn ``turn_id`` (whose masked message was
    ``request``): committed in the same write as the turn, so a retry finds exactly that."""
    runtime = state.runtime
    record = {
        "turn_id": turn_id,
        "request": request_digest(request),
        "reply": reply.model_dump(mode="json"),
    }
    kept = [r for r in runtime.replies if r.get("turn_id") != turn_id]
    replies = (*kept, record)[-_REPLIES_KEPT:]
    return state.model_copy(update={"runtime": runtime.model_copy(update={"replies": replies})})
