"""keel: a runtime that keeps LLM agents from crashing, drifting or forgetting.

The public API is exactly ``__all__``; everything in underscore modules may move.
"""

from __future__ import annotations

from keel import errors
from keel._version import __version__
from keel.errors import (
    ConflictError,
    ContextOverflowError,
    KeelError,
    KeelRuntimeError,
    UsageError,
)
from keel.messages import Message, Role, ToolCall, Usage
from keel.settings import Settings, load_settings
from keel.stores import SQLiteDatabase
from keel.tokens import (
    ChatTokenCounter,
    ModelProfile,
    TokenCount,
    Tokenizer,
    count_tokens,
    counter_for,
    model_profile,
)

__all__ = [
    "ChatTokenCounter",
    "ConflictError",
    "ContextOverflowError",
    "KeelError",
    "KeelRuntimeError",
    "Message",
    "ModelProfile",
    "Role",
    "SQLiteDatabase",
    "Settings",
    "TokenCount",
    "Tokenizer",
    "ToolCall",
    "Usage",
    "UsageError",
    "__version__",
    "count_tokens",
    "counter_for",
    "errors",
    "load_settings",
    "model_profile",
]
