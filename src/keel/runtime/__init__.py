"""The runtime: [`Agent`][] is the configuration and the public API; each turn of
DESIGN.md's flow is run by its own ``TurnRunner`` over the loop's model and tool steps
(model -> validate -> tools -> model, bounded by guards), which [`ToolLoop`][] also drives
standalone."""

from __future__ import annotations

from keel.runtime._agent import Agent, session_key
from keel.runtime._approvals import Approvals
from keel.runtime._events import (
    AgentEvent,
    ApprovalDecided,
    ApprovalRequested,
    CheckpointCommitted,
    GuardWarning,
    TextDelta,
    TextDiscarded,
    ToolCallFinished,
    ToolCallStarted,
    TurnFinished,
    WorkflowTransition,
)
from keel.runtime._reply import AgentReply, AgentStatus, PendingApproval
from keel.runtime._tool_loop import LoopHooks, LoopResult, LoopStatus, StepRecord, ToolLoop
from keel.stores import Backends

__all__ = [
    "Agent",
    "AgentEvent",
    "AgentReply",
    "AgentStatus",
    "ApprovalDecided",
    "ApprovalRequested",
    "Approvals",
    "Backends",
    "CheckpointCommitted",
    "GuardWarning",
    "LoopHooks",
    "LoopResult",
    "LoopStatus",
    "PendingApproval",
    "StepRecord",
    "TextDelta",
    "TextDiscarded",
    "ToolCallFinished",
    "ToolCallStarted",
    "ToolLoop",
    "TurnFinished",
    "WorkflowTransition",
    "session_key",
]
