"""The runtime: the loop that joins models, tools and guards (the Agent builds on it)."""

from __future__ import annotations

from keel.runtime._tool_loop import LoopHooks, LoopResult, LoopStatus, StepRecord, ToolLoop

__all__ = ["LoopHooks", "LoopResult", "LoopStatus", "StepRecord", "ToolLoop"]
