"""What one turn of an [`Agent`][] produced, and the replies a session keeps for retries: a
turn the caller gave its own id (an HTTP ``Idempotency-Key``) runs once; its reply is committed
with the turn, and a retry gets it back."""

from __future__ import annotations

import hashlib
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from keel.errors import UsageError
from keel.runtime._loop_run import LoopStatus
from keel.state import AgentState

__all__ = [
    "AgentReply",
    "AgentStatus",
    "PendingApproval",
    "recorded_reply",
    "request_digest",
    "with_reply",
]

_REPLIES_KEPT = 16
"""Replies kept for turns that came with the caller's own turn id (retries come within minutes)."""

AgentStatus = Literal[LoopStatus, "failed", "escalated"]
"""How a turn ended: ``completed``, a loop status ([`LoopStatus`][], among
them ``awaiting_approval``: parked until a person decides), ``escalated`` (a loop after the
warning or a call in doubt, handed to the operators' queue instead of failing: their answer
resumes it), or ``failed`` (an error the loop does not own: a bug in a hook, a workflow
gate)."""


class PendingApproval(BaseModel):
    """One call of the turn waiting for a person (see ``Agent.decide``)."""

    model_config = ConfigDict(frozen=True)

    id: str = Field(description="The request's id, to decide it with.")
    kind: Literal["user", "operator", "escalation"]
    tool: str | None
    arguments: str = Field(description="The call's arguments (masked).")
    reason: str = Field(description="Why a person must decide (the policy's words).")
    decidable_by: tuple[str, ...] = Field(description="Who may decide: user, operator.")
    expires_at: float | None = Field(description="Epoch seconds; None: never.")
    status: str = Field(description="pending, approved, rejected, expired or cancelled.")


class AgentReply(BaseModel):
    """What one turn produced, for the caller and for dashboards."""

    model_config = ConfigDict(frozen=True)

    text: str = Field(description="The reply for the user (a clean message when it failed).")
    status: AgentStatus = Field(description="How the turn ended: completed, or why it stopped.")
    session_id: str = Field(description="The session.")
    run_id: str = Field(description="The trace's run id (``keel runs show RUN``).")
    state_version: int = Field(description="The state version committed at the end of the turn.")
    workflow_state: str | None = Field(
        default=None, description="The state machine's state after the turn, if there is one."
    )
    steps: int = Field(default=0, description="Model calls made in the turn.")
    max_prompt_tokens: int = Field(default=0, description="Largest prompt sent in the turn.")
    prompt_limit: int = Field(default=0, description="Tokens a prompt may take (window - reserve).")
    loops_detected: int = Field(default=0, description="Loop detections in the turn.")
    tool_calls: tuple[str, ...] = Field(default=(), description="Tools called, in order.")
    effects: tuple[str, ...] = Field(
        default=(),
        description="Side-effecting tools that ran (or may have run) in the turn, in order; "
        "they stay in the history even when the turn failed and the state was reverted.",
    )
    reverted: bool = Field(default=False, description="State went back to the last good version.")
    truncated: bool = Field(
        default=False,
        description="The answer is cut: it kept reaching the token limit and the run's step or "
        "time limit came before it could be continued to its end (``status`` stays "
        '``completed``; an OpenAI-style caller reads it as ``finish_reason: "length"``).',
    )
    resumed: bool = Field(default=False, description="The turn finished one a crash interrupted.")
    replayed: bool = Field(
        default=False,
        description="The reply of a turn committed earlier under the same caller's turn id: "
        "returned again, nothing ran.",
    )
    interrupted_turn: AgentReply | None = Field(
        default=None,
        description="The reply to an earlier message whose turn a crash had left open, finished "
        "before this message was handled.",
    )
    error: str | None = Field(default=None, description="The error, when the turn failed.")
    approvals: tuple[PendingApproval, ...] = Field(
        default=(),
        description="The calls the turn is parked on (``status='awaiting_approval'``).",
    )
    output: Any = Field(
        default=None,
        description="The validated answer when the turn had an ``output_type`` (``text`` is its "
        "JSON, masked; this value is the model's, for the caller only, never stored).",
    )


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
