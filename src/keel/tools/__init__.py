"""Tools a model can call: typed functions, validated arguments, exactly-once side effects.

``@tool`` turns a typed function into a :class:`Tool`; a :class:`ToolRegistry` holds the tools
of a run; a :class:`ToolExecutor` carries out calls (look up, repair, validate, run with a
timeout and an output cap) and journals side-effecting ones in a :class:`ToolJournal` so that
they run at most once per (session, step, call), across crashes.
"""

from __future__ import annotations

from keel.tools._executor import (
    ToolExecutor,
    ToolResult,
    ToolStatus,
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
from keel.tools._registry import ToolRegistry
from keel.tools._repair import (
    ArgumentsNotJSONError,
    RepairedArguments,
    coerce_scalars,
    parse_arguments,
)
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
    "InMemoryJournal",
    "JournalClaim",
    "JournalEntry",
    "JournalStatus",
    "NestedArgumentsWarning",
    "RepairedArguments",
    "Tool",
    "ToolContext",
    "ToolExecutor",
    "ToolJournal",
    "ToolRegistry",
    "ToolResult",
    "ToolScope",
    "ToolStatus",
    "coerce_scalars",
    "format_validation_error",
    "idempotency_key",
    "parse_arguments",
    "tool",
    "validated_arguments",
]
