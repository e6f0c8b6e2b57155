"""keel: a runtime that keeps LLM agents from crashing, drifting or forgetting.

The public API is exactly ``__all__``: what a user needs to build an agent, embedded or by hand
on SQLite, PostgreSQL and Redis. Tokenizer plumbing lives in `keel.tokens` (its old names
here still resolve). Everything in underscore modules may move. Names are loaded on first use,
so ``import keel`` (and every ``keel`` command) starts fast.

```python
from keel import Agent, tool

@tool
def get_weather(city: str) -> str:
    \"\"\"Today's weather.\"\"\"
    return f"Sunny in {city}"

with Agent.embedded("local:smollm2", system_prompt="You are brief.", tools=[get_weather]) as agent:
    reply = agent.run_sync("Weather in Oslo?", session="session-1", user="user-1")
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
    from keel.models import (
        ChatModel,
        Completion,
        LocalModel,
        ModelOptions,
        OpenAICompatibleModel,
        resolve_model,
    )
    from keel.privacy import PIIMasker, mask_pii
    from keel.runtime import (
        Agent,
        AgentEvent,
        AgentReply,
        AgentStatus,
        TextDelta,
        ToolLoop,
        TurnFinished,
    )
    from keel.settings import Settings, load_settings
    from keel.state import (
        AgentState,
        MachineState,
        StateMachine,
        StateStore,
        Transition,
        add_messages,
    )
    from keel.stores import (
        PostgresDatabase,
        PostgresMemoryStore,
        PostgresTraceStore,
        RedisStateBackend,
        SQLiteDatabase,
        SQLiteMemoryStore,
        SQLStateBackend,
        SQLToolJournal,
        SQLTraceStore,
    )
    from keel.tokens import count_tokens
    from keel.tools import (
        FromEnv,
        MCPServer,
        MCPToolOverride,
        Tool,
        ToolContext,
        ToolRegistry,
        schema_tool,
        tool,
    )
    from keel.tracing import RunQuery, Tracer

_LAZY: dict[str, str] = {
    "Agent": "keel.runtime",
    "AgentEvent": "keel.runtime",
    "AgentReply": "keel.runtime",
    "AgentState": "keel.state",
    "AgentStatus": "keel.runtime",
    "BudgetReport": "keel.context",
    "ChatModel": "keel.models",
    "ChatTokenCounter": "keel.tokens",  # moved to keel.tokens; still resolves
    "CompiledPrompt": "keel.context",
    "Completion": "keel.models",
    "ContextBudget": "keel.context",
    "ContextEngine": "keel.context",
    "Conversation": "keel.context",
    "GuardConfig": "keel.guards",
    "LocalModel": "keel.models",
    "MachineState": "keel.state",
    "Memory": "keel.memory",
    "MemoryRecord": "keel.memory",
    "ModelOptions": "keel.models",
    "ModelProfile": "keel.tokens",  # moved to keel.tokens; still resolves
    "OpenAICompatibleModel": "keel.models",
    "PIIMasker": "keel.privacy",
    "PostgresDatabase": "keel.stores",
    "PostgresMemoryStore": "keel.stores",
    "SQLStateBackend": "keel.stores",
    "SQLToolJournal": "keel.stores",
    "PostgresTraceStore": "keel.stores",
    "RedisStateBackend": "keel.stores",
    "RunQuery": "keel.tracing",
    "SQLiteDatabase": "keel.stores",
    "SQLiteMemoryStore": "keel.stores",
    "SQLTraceStore": "keel.stores",
    "Scope": "keel.memory",
    "Settings": "keel.settings",
    "StateMachine": "keel.state",
    "StateStore": "keel.state",
    "TextDelta": "keel.runtime",
    "TokenCount": "keel.tokens",  # moved to keel.tokens; still resolves
    "Tokenizer": "keel.tokens",  # moved to keel.tokens; still resolves
    "Tool": "keel.tools",
    "FromEnv": "keel.tools",
    "MCPServer": "keel.tools",
    "MCPToolOverride": "keel.tools",
    "schema_tool": "keel.tools",
    "ToolContext": "keel.tools",
    "ToolLoop": "keel.runtime",
    "ToolRegistry": "keel.tools",
    "Tracer": "keel.tracing",
    "Transition": "keel.state",
    "TurnFinished": "keel.runtime",
    "add_messages": "keel.state",
    "count_tokens": "keel.tokens",
    "counter_for": "keel.tokens",  # moved to keel.tokens; still resolves
    "load_settings": "keel.settings",
    "mask_pii": "keel.privacy",
    "model_profile": "keel.tokens",  # moved to keel.tokens; still resolves
    "resolve_model": "keel.models",
    "tool": "keel.tools",
}

__all__ = [
    "Agent",
    "AgentEvent",
    "AgentReply",
    "AgentState",
    "AgentStatus",
    "BudgetReport",
    "ChatModel",
    "CompiledPrompt",
    "Completion",
    "ConflictError",
    "ContextBudget",
    "ContextEngine",
    "ContextOverflowError",
    "Conversation",
    "FromEnv",
    "GuardConfig",
    "KeelError",
    "KeelRuntimeError",
    "LocalModel",
    "MCPServer",
    "MCPToolOverride",
    "MachineState",
    "Memory",
    "MemoryRecord",
    "Message",
    "ModelOptions",
    "OpenAICompatibleModel",
    "PIIMasker",
    "PostgresDatabase",
    "PostgresMemoryStore",
    "PostgresTraceStore",
    "RedisStateBackend",
    "Role",
    "RunQuery",
    "SQLStateBackend",
    "SQLToolJournal",
    "SQLTraceStore",
    "SQLiteDatabase",
    "SQLiteMemoryStore",
    "Scope",
    "Settings",
    "StateMachine",
    "StateStore",
    "TextDelta",
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
    "errors",
    "load_settings",
    "mask_pii",
    "resolve_model",
    "schema_tool",
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
