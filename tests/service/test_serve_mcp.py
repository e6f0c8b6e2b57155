"""The service starts its agent's MCP servers at start-up, before it takes traffic: a server
that cannot start fails the start-up with a typed error naming it (not a tenant's first turn),
and the servers stop at shutdown. Against real MCP servers in real processes: keel's fault
server, and a stdio command that exits at once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from keel.errors import ConfigError, StoreError, ToolDefinitionError, UsageError
from keel.service import build_service
from keel.settings import load_settings
from keel.state import MachineState, StateMachine, Transition
from keel.stores._sql_plan import table_names
from keel.testing import ScriptedModel
from keel.testing.mcp_fault_server import stdio_server
from keel.tools import MCPServer
from tests.tools.test_mcp_lifecycle import _servers_running, _until_gone


def _service(tmp_path: Path, server: MCPServer, model: ScriptedModel | None = None) -> tuple:  # type: ignore[type-arg]
    return build_service(
        f"sqlite:///{tmp_path / 'keel.db'}",
        model=model or ScriptedModel(["Hi."]),
        tools=[server],
        memory=False,
        settings=load_settings(data_dir=tmp_path),
        ui=False,
    )


def _notes_machine() -> StateMachine:
    """A state machine: its agent has the workflow's tools (``go_to``, ``remember``)."""
    return StateMachine(
        "notes",
        states=[
            MachineState("open", "taking notes", "Take notes.", ()),
            MachineState("done", "done", "Say goodbye.", (), terminal=True),
        ],
        transitions=[Transition("open", "done")],
        initial="open",
    )


async def test_the_service_starts_its_server_before_any_request_and_stops_it_at_shutdown(
    tmp_path: Path,
) -> None:
    effects = tmp_path / "effects.txt"
    model = ScriptedModel([ScriptedModel.tool_call("echo", json.dumps({"text": "hi"})), "Done."])
    app, agents, _ = _service(tmp_path, stdio_server(effects), model)
    assert _servers_running(effects) == []  # built: nothing started
    async with app.router.lifespan_context(app):
        assert len(_servers_running(effects)) == 1  # started at start-up, no request yet
        reply = await agents("acme").handle("s1", "u1", "Echo.")
        assert reply.status == "completed", reply
        assert len(_servers_running(effects)) == 1  # the tenant's agent used the same one
    await _until_gone(effects)


async def test_a_start_up_that_fails_after_the_servers_started_stops_them(
    tmp_path: Path,
) -> None:
    """The servers start first; memory's embedder loads after them, before traffic. An
    embedder that cannot load fails the start-up, and what was started is stopped: the MCP
    server's process and the stores."""
    effects = tmp_path / "effects.txt"
    # Its folder has its configuration but no tokenizer: it is built, and fails to load.
    folder = tmp_path / "embedder"
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps({"hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1})
    )
    app, agents, _ = build_service(
        f"sqlite:///{tmp_path / 'keel.db'}",
        model=ScriptedModel(["Hi."]),
        tools=[stdio_server(effects)],
        settings=load_settings(data_dir=tmp_path, embedder=f"local:{folder}"),
        ui=False,
    )
    with pytest.raises(ConfigError, match=r"no tokenizer\.json"):
        async with app.router.lifespan_context(app):
            pytest.fail("the service started with an embedder that cannot load")
    await _until_gone(effects)
    with pytest.raises(StoreError, match="closed"):
        table_names(agents.backends.sql)


async def test_shutdown_stops_the_servers_and_closes_the_stores_whatever_fails_to_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    effects = tmp_path / "effects.txt"
    model = ScriptedModel(["Hi."])
    app, agents, _ = _service(tmp_path, stdio_server(effects), model)

    async def fails() -> None:
        raise RuntimeError("could not close")

    with pytest.raises(RuntimeError, match="could not close"):
        async with app.router.lifespan_context(app):
            assert len(_servers_running(effects)) == 1
            monkeypatch.setattr(agents("acme"), "aclose", fails)
            monkeypatch.setattr(model, "aclose", fails)
    # The tenant's agent and the model failed to close: the service's server is stopped and
    # its stores closed all the same.
    await _until_gone(effects)
    with pytest.raises(StoreError, match="closed"):
        table_names(agents.backends.sql)


async def test_a_server_that_exits_at_once_fails_the_start_up_naming_it(tmp_path: Path) -> None:
    quitter = MCPServer.stdio(
        sys.executable,
        ["-c", "import sys; sys.stderr.write('no such flag: --bogus\\n'); sys.exit(3)"],
        name="quitter",
    )
    app, agents, _ = _service(tmp_path, quitter)
    said = r"MCP server 'quitter' .*before listing its tools"
    with pytest.raises(ToolDefinitionError, match=said):
        async with app.router.lifespan_context(app):
            pytest.fail("the service started with a server that exited")
    assert quitter.tools() == {} and agents.tenants() == []
    assert "connection" not in quitter._state  # stopped again: no supervisor retries it


_NOTES_SERVER = """
from mcp.server.mcpserver import MCPServer

server = MCPServer("notes")


@server.tool()
def remember(text: str) -> str:
    return text


server.run()
"""


async def test_a_server_tool_named_as_a_workflow_tool_fails_the_start_up(tmp_path: Path) -> None:
    """An agent with a state machine has the workflow's tools (``go_to``, ``remember``): a
    server listing one of those names would fail every tenant's agent as it is built, so it
    fails the start-up instead, and the server is stopped."""
    machine = _notes_machine()
    env = {"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ else {}
    notes = MCPServer.stdio(sys.executable, ["-c", _NOTES_SERVER], name="notes", env=env)
    app, agents, _ = build_service(
        f"sqlite:///{tmp_path / 'keel.db'}",
        model=ScriptedModel(["Hi."]),
        tools=[notes],
        machine=machine,
        memory=False,
        settings=load_settings(data_dir=tmp_path),
        ui=False,
    )
    said = "tool 'remember' of MCP server 'notes' clashes with the workflow's"
    with pytest.raises(ToolDefinitionError, match=said):
        async with app.router.lifespan_context(app):
            pytest.fail("the service started with a server whose tool the workflow reserves")
    assert "connection" not in notes._state and agents.tenants() == []


async def test_a_failed_start_up_stops_every_server_whichever_fails_to_stop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The start-up fails after two servers started (one lists a tool the workflow reserves),
    and the first one it stops raises: the other is stopped all the same, and the start-up's
    own error is the one raised. (A real server does not fail to stop on demand: its
    ``aclose`` is replaced.)"""
    machine = _notes_machine()
    effects = tmp_path / "effects.txt"
    env = {"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ else {}
    notes = MCPServer.stdio(sys.executable, ["-c", _NOTES_SERVER], name="notes", env=env)
    stops = MCPServer.aclose

    async def aclose(server: MCPServer) -> None:
        if server is notes:
            raise RuntimeError("could not stop")
        await stops(server)

    monkeypatch.setattr(MCPServer, "aclose", aclose)
    app, _, _ = build_service(
        f"sqlite:///{tmp_path / 'keel.db'}",
        model=ScriptedModel(["Hi."]),
        tools=[stdio_server(effects), notes],  # stopped in reverse: notes first
        machine=machine,
        memory=False,
        settings=load_settings(data_dir=tmp_path),
        ui=False,
    )
    try:
        with pytest.raises(Exception) as raised:
            async with app.router.lifespan_context(app):
                pytest.fail("the service started with a server whose tool the workflow reserves")
        assert isinstance(raised.value, ToolDefinitionError), repr(raised.value)
        assert "clashes with the workflow's" in str(raised.value)
        await _until_gone(effects)  # the other server's process is gone
    finally:
        await stops(notes)


async def test_servers_sharing_a_tool_name_are_all_stopped_whichever_fails_to_stop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two servers list the same tool names: the start-up fails once both started, and the
    first one it stops raises. The other is stopped all the same, and the start-up's own error
    is the one raised. (A real server does not fail to stop on demand: its ``close`` is
    replaced.)"""
    first_effects, second_effects = tmp_path / "first.txt", tmp_path / "second.txt"
    first = stdio_server(first_effects, name="first")
    second = stdio_server(second_effects, name="second")
    stops = MCPServer.close

    def close(server: MCPServer) -> None:
        if server is first:
            raise RuntimeError("could not stop")
        stops(server)

    monkeypatch.setattr(MCPServer, "close", close)
    app, _, _ = build_service(
        f"sqlite:///{tmp_path / 'keel.db'}",
        model=ScriptedModel(["Hi."]),
        tools=[first, second],
        memory=False,
        settings=load_settings(data_dir=tmp_path),
        ui=False,
    )
    try:
        with pytest.raises(Exception) as raised:
            async with app.router.lifespan_context(app):
                pytest.fail("the service started with two servers listing one tool name")
        assert isinstance(raised.value, ToolDefinitionError), repr(raised.value)
        await _until_gone(second_effects)  # the other server's process is gone
    finally:
        await first.aclose()


async def test_a_python_tool_named_as_a_workflow_tool_fails_the_start_up(tmp_path: Path) -> None:
    """As a server's tool of that name does (above), with no server to start: not every
    tenant's first request, as its agent is built."""
    from keel.state import MachineState, StateMachine, Transition
    from keel.tools import tool

    @tool
    def remember(text: str) -> str:
        """Keep a note."""
        return text

    machine = StateMachine(
        "notes",
        states=[
            MachineState("open", "taking notes", "Take notes.", ()),
            MachineState("done", "done", "Say goodbye.", (), terminal=True),
        ],
        transitions=[Transition("open", "done")],
        initial="open",
    )
    app, agents, _ = build_service(
        f"sqlite:///{tmp_path / 'keel.db'}",
        model=ScriptedModel(["Hi."]),
        tools=[remember],
        machine=machine,
        memory=False,
        settings=load_settings(data_dir=tmp_path),
        ui=False,
    )
    started = False
    with pytest.raises(UsageError, match=r"\['remember'\] are reserved for the workflow"):
        async with app.router.lifespan_context(app):
            started = True
    assert not started, "the service started with a tool the workflow reserves"
    assert agents.tenants() == []


async def test_a_server_whose_command_cannot_run_fails_the_start_up(tmp_path: Path) -> None:
    broken = MCPServer.stdio(str(tmp_path / "no-such-server"), name="broken")
    app, _, _ = _service(tmp_path, broken)
    with pytest.raises(ToolDefinitionError, match="'broken' could not be started"):
        async with app.router.lifespan_context(app):
            pytest.fail("the service started with a server that cannot run")


_BROKEN_AGENT = """
import sys

from keel.runtime import Agent
from keel.testing import ScriptedModel
from keel.tools import MCPServer


def build(settings):
    quitter = MCPServer.stdio(
        sys.executable,
        ["-c", "import sys; sys.stderr.write('no such flag: --bogus\\\\n'); sys.exit(3)"],
        name="quitter",
    )
    return Agent.open(
        settings, model=ScriptedModel(["Hi."]), system_prompt="Hi.", tools=[quitter], memory=False
    )
"""


def test_keel_serve_does_not_start_with_a_server_that_exits(tmp_path: Path) -> None:
    (tmp_path / "broken_agent.py").write_text(_BROKEN_AGENT)
    source = str(Path(__file__).resolve().parents[2] / "src")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([source, os.environ.get("PYTHONPATH", "")]),
        "KEEL_DATA_DIR": str(tmp_path / "data"),
    }
    served = subprocess.run(
        [sys.executable, "-m", "keel", "serve", "--port", "0", "--agent", "broken_agent:build"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert served.returncode != 0, served.stderr
    said = "ToolDefinitionError: MCP server 'quitter' exited with code 3 before listing its tools"
    assert said in served.stderr, served.stderr
    assert "no such flag: --bogus" in served.stderr
