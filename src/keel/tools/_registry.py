"""The set of tools a run may call, looked up by name, with suggestions for wrong names."""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from keel.errors import ToolDefinitionError
from keel.tools._tool import Tool, tool

__all__ = ["ToolRegistry"]


class ToolRegistry:
    """Tools by name. Plain typed functions are turned into tools with [`tool`][] defaults.

    Raises:
        ToolDefinitionError: two tools share a name.
    """

    def __init__(self, tools: Iterable[Tool | Callable[..., Any]] = ()) -> None:
        self._tools: dict[str, Tool] = {}
        self._schemas: str | None = None
        for item in tools:
            self.register(item)

    def register(self, item: Tool | Callable[..., Any]) -> Tool:
        """Add a tool (or a typed function, wrapped with ``@tool``); returns the tool."""
        built = item if isinstance(item, Tool) else tool(item)
        if built.name in self._tools:
            raise ToolDefinitionError(f"a tool named {built.name!r} is already registered")
        self._tools[built.name] = built
        self._schemas = None
        return built

    def get(self, name: str) -> Tool | None:
        """The tool called ``name``, or None."""
        return self._tools.get(name)

    def __getitem__(self, name: str) -> Tool:
        return self._tools[name]

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __iter__(self) -> Iterator[Tool]:
        return iter(self._tools.values())

    def __len__(self) -> int:
        return len(self._tools)

    @property
    def names(self) -> list[str]:
        """Tool names in registration order."""
        return list(self._tools)

    def schemas(self) -> list[dict[str, Any]]:
        """Every tool in the OpenAI ``tools`` format, in registration order."""
        if self._schemas is None:
            # Kept as JSON text: each caller gets its own copy (a model may change what it is
            # given) from one C call, at a fraction of a deep copy's cost (the schemas are JSON).
            texts = (registered._schema_text for registered in self._tools.values())
            self._schemas = f"[{','.join(texts)}]"
        schemas: list[dict[str, Any]] = json.loads(self._schemas)
        return schemas

    def suggest(self, name: str, limit: int = 3) -> list[str]:
        """The valid tool names closest to ``name`` (case-insensitive), best first."""
        lowered = {candidate.lower(): candidate for candidate in self._tools}
        wanted = name.strip().lower()
        close = difflib.get_close_matches(wanted, list(lowered), n=limit, cutoff=0.5)
        found = [lowered[match] for match in close]
        for key, candidate in lowered.items():
            if len(found) >= limit:
                break
            if candidate not in found and wanted and (wanted in key or key in wanted):
                found.append(candidate)
        return found

    def __repr__(self) -> str:
        return f"ToolRegistry({self.names!r})"
