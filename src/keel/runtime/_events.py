"""What [`Agent.stream`][] yields while a turn runs: typed events, one union.

Every text in an event is masked by the agent's privacy policy before it is yielded, as the
committed history is. The last event of a turn that ran is always [`TurnFinished`][] with the
[`AgentReply`][], whose ``text`` is authoritative: the text deltas of a step
that turned out unusable (the model is asked again) are withdrawn by a [`TextDiscarded`][],
and a turn that fails ends with the clean message for the user in the reply.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from keel.runtime._reply import AgentReply, PendingApproval

__all__ = [
    "AgentEvent",
    "ApprovalDecided",
    "ApprovalRequested",
    "CheckpointCommitted",
    "GuardWarning",
    "TextDelta",
    "TextDiscarded",
    "ToolCallFinished",
    "ToolCallStarted",
    "TurnFinished",
    "WorkflowTransition",
]


class _Event(BaseModel):
    model_config = ConfigDict(frozen=True)


class TextDelta(_Event):
    """More characters of the model's reply in ``step`` (masked; a placeholder is never split)."""

    type: Literal["text"] = "text"
    step: int = Field(description="The step (model call) the text belongs to.")
    text: str = Field(description="The new characters.")


class TextDiscarded(_Event):
    """The text streamed in ``step`` is not part of the answer: the reply was unusable (cut
    short, malformed, a failed model call) and the model is asked again. A UI clears it."""

    type: Literal["text_discarded"] = "text_discarded"
    step: int
    reason: str = Field(description="Why the step's reply was not used.")


class ToolCallStarted(_Event):
    """A tool call passed validation and runs now."""

    type: Literal["tool_call_started"] = "tool_call_started"
    step: int
    call_id: str
    name: str = Field(description="The tool.")
    arguments: dict[str, Any] = Field(description="The validated arguments (masked).")


class ToolCallFinished(_Event):
    """A tool call ended: its result for the model, or why it failed (masked)."""

    type: Literal["tool_call_finished"] = "tool_call_finished"
    step: int
    call_id: str
    name: str
    status: str = Field(description="ok, or how it failed (invalid_arguments, timeout, ...).")
    ok: bool
    result: str = Field(description="What the model is told: the output, or the error.")


class WorkflowTransition(_Event):
    """The workflow moved from one state to another."""

    type: Literal["transition"] = "transition"
    source: str = Field(description="The state it left.")
    target: str = Field(description="The state it entered.")


class CheckpointCommitted(_Event):
    """A checkpoint of the session was committed (before each model call, after a transition,
    at the end of the turn)."""

    type: Literal["checkpoint"] = "checkpoint"
    version: int = Field(description="The state version now committed.")
    reason: str = Field(description="Why it was written.")


class GuardWarning(_Event):
    """A guard saw something: a loop warning, an unusable reply, repaired arguments."""

    type: Literal["guard"] = "guard"
    step: int
    message: str


class ApprovalRequested(_Event):
    """A call waits for a person's decision before it runs (the turn parks after its step)."""

    type: Literal["approval_requested"] = "approval_requested"
    step: int
    approval: PendingApproval


class ApprovalDecided(_Event):
    """A waiting call was decided (or expired, or was cancelled): what comes of it."""

    type: Literal["approval_decided"] = "approval_decided"
    approval_id: str
    status: str = Field(description="approved, rejected, expired or cancelled.")
    by: str | None = Field(default=None, description="Who decided (None: expired, cancelled).")
    result: str = Field(description="What the model is told of it (masked).")


class TurnFinished(_Event):
    """The turn ended; ``reply`` is what [`Agent.run`][] would have returned."""

    type: Literal["final"] = "final"
    reply: AgentReply


AgentEvent = Annotated[
    TextDelta
    | TextDiscarded
    | ToolCallStarted
    | ToolCallFinished
    | WorkflowTransition
    | CheckpointCommitted
    | GuardWarning
    | ApprovalRequested
    | ApprovalDecided
    | TurnFinished,
    Field(discriminator="type"),
]
"""One event of a streamed turn (discriminated by ``type``)."""
