"""Chat models behind one interface: OpenAI-compatible HTTP, the bundled local model, scripted."""

from __future__ import annotations

from keel.models._base import (
    ChatModel,
    Completion,
    CompletionChunk,
    FinishReason,
    ModelOptions,
    ToolCallDelta,
    ToolSchema,
)

__all__ = [
    "ChatModel",
    "Completion",
    "CompletionChunk",
    "FinishReason",
    "ModelOptions",
    "ToolCallDelta",
    "ToolSchema",
]
