"""Chat models behind one interface: OpenAI-compatible HTTP, the bundled local model, scripted.

``resolve_model("openai:gpt-4o-mini")`` (or ``openai-compatible:MODEL@URL``, ``local:smollm2``,
``scripted:NAME``) gives a [`ChatModel`][]; ``complete``/``acomplete`` return a checked
[`Completion`][], ``stream``/``astream`` yield [`CompletionChunk`][] s. Retries live in
one place, [`RetryPolicy`][]; failures surface as [`keel.errors`][] types.
"""

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
from keel.models._local import LocalModel, loaded_local_models
from keel.models._openai import OpenAICompatibleModel, is_context_length_error
from keel.models._registry import resolve_model
from keel.models._retry import RetryPolicy
from keel.models._toolcalls import (
    ParsedToolCalls,
    ToolCallParseError,
    parse_tool_calls,
    render_tool_call,
    render_tools_prompt,
)

__all__ = [
    "ChatModel",
    "Completion",
    "CompletionChunk",
    "FinishReason",
    "LocalModel",
    "ModelOptions",
    "OpenAICompatibleModel",
    "ParsedToolCalls",
    "RetryPolicy",
    "ToolCallDelta",
    "ToolCallParseError",
    "ToolSchema",
    "is_context_length_error",
    "loaded_local_models",
    "parse_tool_calls",
    "render_tool_call",
    "render_tools_prompt",
    "resolve_model",
]
