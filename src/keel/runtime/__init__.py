"""The runtime: :class:`Agent` runs one turn of DESIGN.md's flow over the inner
:class:`ToolLoop` (model -> validate -> tools -> model, bounded by guards)."""

from __future__ import annotations

from keel.runtime._agent import Agent, AgentReply
from keel.runtime._backends import Backends, open_backends
from keel.runtime._tool_loop import LoopHooks, LoopResult, LoopStatus, StepRecord, ToolLoop

__all__ = [
    "Agent",
    "AgentReply",
    "Backends",
    "LoopHooks",
    "LoopResult",
    "LoopStatus",
    "StepRecord",
    "ToolLoop",
    "open_backends",
]
