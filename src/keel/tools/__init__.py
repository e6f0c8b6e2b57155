"""Tools a model can call: typed functions, validated arguments, exactly-once side effects.

``@tool`` turns a typed function into a [`Tool`][]; a [`ToolRegistry`][] holds the tools
of a run; a [`ToolExecutor`][] carries out calls (look up, repair, validate, run with a
timeout and an output cap) and journals side-effecting ones in a [`ToolJournal`][] so that
they run at most once per (session, step, call), across crashes.
"""

from __future__ import annotations

from keel._model_json import (
    ArgumentsNotJSONError,
    RepairedArguments,
    coerce_scalars,
    parse_arguments,
)
from keel.tools._executor import (
    ToolExecutor,
    ToolResult,
    ToolStatus,
    avalidated_arguments,
    format_validation_error,
    validated_arguments,
)
from keel.tools._journal import (
    InMemoryJournal,
    JournalClaim,
    JournalEntry,
    JournalStatus,
    ToolJournal,
    idempotency_key,
)
from keel.tools._mcp import (
    FromEnv,
    MCPServer,
    MCPToolError,
    MCPToolOverride,
    start_servers,
)
from keel.tools._registry import ToolRegistry
from keel.tools._schema_tool import SchemaTool, schema_tool
from keel.tools._tool import (
    ApprovalNeed,
    ApprovalPolicy,
    NestedArgumentsWarning,
    Tool,
    ToolContext,
    ToolScope,
    tool,
)

__all__ = [
    "ApprovalNeed",
    "ApprovalPolicy",
    "ArgumentsNotJSONError",
    "FromEnv",
    "InMemoryJournal",
    "JournalClaim",
    "JournalEntry",
    "JournalStatus",
    "MCPServer",
    "MCPToolError",
    "MCPToolOverride",
    "NestedArgumentsWarning",
    "RepairedArguments",
    "SchemaTool",
    "Tool",
    "ToolContext",
    "ToolExecutor",
    "ToolJournal",
    "ToolRegistry",
    "ToolResult",
    "ToolScope",
    "ToolStatus",
    "avalidated_arguments",
    "coerce_scalars",
    "format_validation_error",
    "idempotency_key",
    "parse_arguments",
    "schema_tool",
    "start_servers",
    "tool",
    "validated_arguments",
]
