"""keel: a runtime that keeps LLM agents from crashing, drifting or forgetting.

The public API is exactly ``__all__``; everything in underscore modules may move. Names are
loaded on first use, so ``import keel`` (and every ``keel`` command) starts fast.

```python
from keel import Agent, tool

@tool
def get_weather(city: str) -> str:
    \"\"\"Today's weather.\"\"\"
    return f"Sunny in {city}"

agent = Agent.embedded("local:smollm2", system_prompt="You are brief.", tools=[get_weather])
reply = agent.handle_sync("session-1", "user-1", "Weather in Oslo?")
```
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

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

# A library never decides where its log records go: without this, Python's last-resort handler
# prints keel's warnings (guards, tracing) on stderr of every program that did not configure
# logging. The application's configuration (or ``keel``'s CLI, to its log file) decides.
logging.getLogger("keel").addHandler(logging.NullHandler())

if TYPE_CHECKING:
    from keel.context import (
        BudgetReport,
        CompiledPrompt,
        ContextBudget,
        ContextEngine,
        Conversation,
    )
    from keel.guards import GuardConfig
    from keel.memory import Memory, MemoryRecord, Scope
    from keel.models import ChatModel, Completion, ModelOptions, resolve_model
    from keel.privacy import PIIMasker, mask_pii
    from keel.runtime import Agent, AgentEvent, AgentReply, TextDelta, ToolLoop, TurnFinished
    from keel.settings import Settings, load_settings
    from keel.state import (
        AgentState,
        MachineState,
        StateMachine,
        StateStore,
        Transition,
        add_messages,
    )
    from keel.stores import SQLiteDatabase, open_database
    from keel.tokens import (
        ChatTokenCounter,
        ModelProfile,
        TokenCount,
        Tokenizer,
        count_tokens,
        counter_for,
        model_profile,
    )
    from keel.tools import Tool, ToolContext, ToolRegistry, tool
    from keel.tracing import RunQuery, Tracer

_LAZY: dict[str, str] = {
    "Agent": "keel.runtime",
    "AgentEvent": "keel.runtime",
    "AgentReply": "keel.runtime",
    "AgentState": "keel.state",
    "BudgetReport": "keel.context",
    "ChatModel": "keel.models",
    "ChatTokenCounter": "keel.tokens",
    "CompiledPrompt": "keel.context",
    "Completion": "keel.models",
    "ContextBudget": "keel.context",
    "ContextEngine": "keel.context",
    "Conversation": "keel.context",
    "GuardConfig": "keel.guards",
    "MachineState": "keel.state",
    "Memory": "keel.memory",
    "MemoryRecord": "keel.memory",
    "ModelOptions": "keel.models",
    "ModelProfile": "keel.tokens",
    "PIIMasker": "keel.privacy",
    "RunQuery": "keel.tracing",
    "SQLiteDatabase": "keel.stores",
    "Scope": "keel.memory",
    "Settings": "keel.settings",
    "StateMachine": "keel.state",
    "StateStore": "keel.state",
    "TokenCount": "keel.tokens",
    "Tokenizer": "keel.tokens",
    "Tool": "keel.tools",
    "ToolContext": "keel.tools",
    "ToolLoop": "keel.runtime",
    "ToolRegistry": "keel.tools",
    "TextDelta": "keel.runtime",
    "Tracer": "keel.tracing",
    "Transition": "keel.state",
    "TurnFinished": "keel.runtime",
    "add_messages": "keel.state",
    "count_tokens": "keel.tokens",
    "counter_for": "keel.tokens",
    "load_settings": "keel.settings",
    "mask_pii": "keel.privacy",
    "model_profile": "keel.tokens",
    "open_database": "keel.stores",
    "resolve_model": "keel.models",
    "tool": "keel.tools",
}

__all__ = [
    "Agent",
    "AgentEvent",
    "AgentReply",
    "AgentState",
    "BudgetReport",
    "ChatModel",
    "ChatTokenCounter",
    "CompiledPrompt",
    "Completion",
    "ConflictError",
    "ContextBudget",
    "ContextEngine",
    "ContextOverflowError",
    "Conversation",
    "GuardConfig",
    "KeelError",
    "KeelRuntimeError",
    "MachineState",
    "Memory",
    "MemoryRecord",
    "Message",
    "ModelOptions",
    "ModelProfile",
    "PIIMasker",
    "Role",
    "RunQuery",
    "SQLiteDatabase",
    "Scope",
    "Settings",
    "StateMachine",
    "StateStore",
    "TextDelta",
    "TokenCount",
    "Tokenizer",
    "Tool",
    "ToolCall",
    "ToolContext",
    "ToolLoop",
    "ToolRegistry",
    "Tracer",
    "Transition",
    "TurnFinished",
    "Usage",
    "UsageError",
    "__version__",
    "add_messages",
    "count_tokens",
    "counter_for",
    "errors",
    "load_settings",
    "mask_pii",
    "model_profile",
    "open_database",
    "resolve_model",
    "tool",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'keel' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
