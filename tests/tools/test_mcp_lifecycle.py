"""Who starts and stops an MCP server an agent is given: building the agent starts nothing; the
agent starts a server nobody started on its first turn (or as ``async with agent:`` begins),
with a typed error when it cannot; ``aclose`` stops it (the server process is gone), unless
another agent still uses it or its owner started it. Against keel's own fault server, a real
MCP server in a real process."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import psutil
import pytest

from keel.errors import ToolDefinitionError
from keel.messages import Message
from keel.runtime import Agent
from keel.testing import ScriptedModel
from keel.testing.mcp_fault_server import stdio_server
from keel.tools import MCPServer, tool


def _call(tool_name: str, **arguments: object) -> Message:
    return ScriptedModel.tool_call(tool_name, json.dumps(arguments))


def _servers_running(effects: Path) -> list[psutil.Process]:
    """This process's children that run the fault server writing to ``effects``."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.is_running() and str(effects) in child.cmdline():
                found.append(child)
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return found


async def _until_gone(effects: Path, deadline_s: float = 30.0) -> None:
    # A stopped server's process exits a little later on a loaded machine: polled, bounded.
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if not _servers_running(effects):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the MCP server is still running: {_servers_running(effects)}")


def _agent(model: ScriptedModel, *servers: MCPServer) -> Agent:
    return Agent.embedded(model, system_prompt="You test.", tools=list(servers), memory=False)


async def test_the_agent_starts_its_server_on_the_first_turn_and_aclose_stops_it(
    tmp_path: Path,
) -> None:
    effects = tmp_path / "effects.txt"
    server = stdio_server(effects)
    model = ScriptedModel([_call("echo", text="hi"), "Done."])
    agent = _agent(model, server)
    assert _servers_running(effects) == [] and server.tools() == {}  # built: nothing started
    reply = await agent.handle("s1", "u1", "Echo.")
    assert reply.status == "completed", reply
    assert "echo" in {schema["function"]["name"] for schema in model.calls[0].tools}
    assert len(_servers_running(effects)) == 1
    await agent.aclose()
    await _until_gone(effects)
    assert server.tools() == {}


async def test_a_shared_server_stops_with_the_last_agent_and_an_owners_server_never(
    tmp_path: Path,
) -> None:
    effects = tmp_path / "effects.txt"
    shared = stdio_server(effects)
    first, second = _agent(ScriptedModel(["One."]), shared), _agent(ScriptedModel(["Two."]), shared)
    await first.handle("s1", "u1", "Hi.")
    await second.handle("s2", "u1", "Hi.")
    assert len(_servers_running(effects)) == 1  # one server for both
    await first.aclose()
    assert len(_servers_running(effects)) == 1 and "echo" in shared.tools()
    await second.aclose()
    await _until_gone(effects)

    owned = tmp_path / "owned.txt"
    async with stdio_server(owned) as server:
        agent = _agent(ScriptedModel(["Hi."]), server)
        await agent.handle("s1", "u1", "Hi.")
        await agent.aclose()
        assert len(_servers_running(owned)) == 1 and "echo" in server.tools()
    await _until_gone(owned)


async def test_a_server_that_cannot_start_fails_the_first_turn_with_a_typed_error(
    tmp_path: Path,
) -> None:
    broken = MCPServer.stdio(str(tmp_path / "no-such-server"), name="broken")
    agent = _agent(ScriptedModel(["Hi."]), broken)  # building it starts nothing: no error
    with pytest.raises(ToolDefinitionError, match="'broken' could not be started"):
        await agent.handle("s1", "u1", "Hi.")
    with pytest.raises(ToolDefinitionError, match="'broken' could not be started"):
        async with agent:
            pass
    await agent.aclose()


async def test_a_name_clash_with_a_server_started_on_the_first_turn_is_refused_then(
    tmp_path: Path,
) -> None:
    effects = tmp_path / "effects.txt"

    @tool
    def echo(text: str) -> str:
        """Echo locally."""
        return text

    agent = _agent(ScriptedModel(["Hi."]), echo, stdio_server(effects))
    with pytest.raises(ToolDefinitionError, match="'echo' of MCP server 'fault' clashes"):
        await agent.handle("s1", "u1", "Hi.")
    await _until_gone(effects)  # the server started for the check is stopped again
    await agent.aclose()


def test_the_sync_context_manager_starts_the_server_and_stops_it_at_the_end(
    tmp_path: Path,
) -> None:
    effects = tmp_path / "effects.txt"
    model = ScriptedModel([_call("echo", text="hi"), "Done."])
    with _agent(model, stdio_server(effects)) as agent:
        assert len(_servers_running(effects)) == 1
        assert agent.handle_sync("s1", "u1", "Echo.").status == "completed"
    asyncio.run(_until_gone(effects))
