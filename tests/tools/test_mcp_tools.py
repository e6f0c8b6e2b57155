"""Tools from an MCP server, through the Agent, against keel's own fault server (a real MCP
server in a real process): annotations set the flags, the deployment's overrides win, a server
that dies mid-write leaves the write in doubt and is restarted, a hang is bounded by the tool's
timeout, an isError result, a huge output, a malformed schema and a changed listing are each
a clear result, and a secret given from the environment is never logged, traced or printed."""

from __future__ import annotations

import hashlib
import json
import logging
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from keel.errors import ToolDefinitionError
from keel.messages import Message, ToolCall
from keel.runtime import Agent
from keel.testing import ScriptedModel
from keel.testing.mcp_fault_server import http_process, stdio_server
from keel.testing.servers import free_port
from keel.tools import FromEnv, MCPServer, MCPToolOverride, ToolExecutor, ToolRegistry, tool


@pytest.fixture
def effects(tmp_path: Path) -> Path:
    return tmp_path / "effects.txt"


@pytest.fixture
def fault(effects: Path) -> Iterator[MCPServer]:
    with stdio_server(
        effects,
        tools={
            "hang": MCPToolOverride(timeout_s=0.5),
            "huge": MCPToolOverride(max_output_chars=100),
            "count": MCPToolOverride(hidden=True),
        },
    ) as server:
        yield server


def _written(effects: Path) -> list[str]:
    return effects.read_text().splitlines() if effects.exists() else []


def _tool_texts(agent: Agent, session: str = "s1") -> list[str]:
    state = agent.session_state(session)
    assert state is not None
    return [message.content for message in state.messages if message.role == "tool"]


def _call(tool_name: str, **arguments: object) -> Message:
    return ScriptedModel.tool_call(tool_name, json.dumps(arguments))


def test_annotations_set_the_flags_and_the_deployment_overrides_them(fault: MCPServer) -> None:
    tools = fault.tools()
    assert (tools["echo"].side_effect, tools["echo"].idempotent) == (False, True)
    # Unannotated: side-effecting and not idempotent (the safe default).
    assert (tools["write"].side_effect, tools["write"].idempotent) == (True, False)
    assert "count" not in tools and "bad_schema" not in tools
    assert tools["hang"].timeout_s == 0.5
    assert any("bad_schema" in problem for problem in fault.problems)
    assert fault.call("count") == "0"  # hidden from the model, not from the deployment
    overridden = MCPServer.stdio(
        fault.command or "",
        fault.args,
        env=fault.env,
        name="again",
        tools={
            "write": MCPToolOverride(side_effect=False),
            "echo": MCPToolOverride(idempotent=False),
        },
    )
    with overridden:
        again = overridden.tools()
        assert not again["write"].side_effect and not again["echo"].idempotent


async def test_a_server_that_dies_mid_write_leaves_it_in_doubt_and_never_runs_it_again(
    fault: MCPServer, effects: Path
) -> None:
    crash = _call("write", item="crash:1")
    model = ScriptedModel([crash, crash, _call("echo", text="hi"), "ok"])
    agent = Agent.embedded(model, system_prompt="You write.", tools=[fault], memory=False)
    first = await agent.handle("s1", "u1", "Write it.")
    assert first.status == "tool_in_doubt", first
    assert "lost its MCP server 'fault' mid-call" in (first.error or "")
    again = await agent.handle("s1", "u1", "Write it again.")
    assert again.status == "tool_in_doubt"
    assert _written(effects) == ["crash:1"]  # applied once, never repeated
    # The server was started again: the next call works.
    third = await agent.handle("s1", "u1", "Say hi.")
    assert third.status == "completed" and _tool_texts(agent)[-1] == "hi"
    await agent.aclose()


async def test_a_hang_an_error_and_a_huge_output_each_end_as_a_clear_result(
    fault: MCPServer,
) -> None:
    model = ScriptedModel(
        [_call("hang"), _call("fail", reason="no such order"), _call("huge", chars=5000), "Done."]
    )
    agent = Agent.embedded(model, system_prompt="You test.", tools=[fault], memory=False)
    reply = await agent.handle("s1", "u1", "Go.")
    assert reply.status == "completed", reply
    hang, fail, huge = _tool_texts(agent)
    assert "did not finish within 0.5 s" in hang
    assert "failed: MCPToolError: " in fail and "no such order" in fail
    assert huge.startswith("x" * 100) and "[output truncated: 5000 characters" in huge
    await agent.aclose()


async def test_the_listing_follows_the_server_when_it_changes(fault: MCPServer) -> None:
    model = ScriptedModel(
        [
            *(_call("add_tool", name="late_tool"), "Added.", _call("late_tool"), "Called."),
            *(_call("remove_tool", name="late_tool"), "Removed.", _call("late_tool"), "Gone."),
        ]
    )
    agent = Agent.embedded(model, system_prompt="You test.", tools=[fault], memory=False)
    assert "late_tool" not in fault.tools()
    await agent.handle("s1", "u1", "Add it.")
    await _until(lambda: "late_tool" in fault.tools())
    called = await agent.handle("s1", "u1", "Call it.")
    assert called.status == "completed" and _tool_texts(agent)[-1] == "late_tool"
    names = {schema["function"]["name"] for schema in model.calls[-1].tools}
    assert "late_tool" in names
    await agent.handle("s1", "u1", "Remove it.")
    await _until(lambda: "late_tool" not in fault.tools())
    await agent.handle("s1", "u1", "Call it.")
    assert "there is no tool named 'late_tool'" in _tool_texts(agent)[-1]
    await agent.aclose()


async def _until(condition: object) -> None:
    import asyncio  # only this helper polls

    for _ in range(400):
        if callable(condition) and condition():
            return
        await asyncio.sleep(0.025)
    raise AssertionError("the condition never held")


async def test_injected_arguments_are_neither_seen_nor_chosen_by_the_model(effects: Path) -> None:
    server = stdio_server(effects, tools={"echo": MCPToolOverride(inject={"text": "from-deploy"})})
    with server:
        assert server.tools()["echo"].parameters_schema()["properties"] == {}
        model = ScriptedModel([_call("echo"), _call("echo", text="mine"), "Done."])
        agent = Agent.embedded(model, system_prompt="You test.", tools=[server], memory=False)
        await agent.handle("s1", "u1", "Echo.")
        # The deployment's value, whatever the model wrote.
        assert _tool_texts(agent) == ["from-deploy", "from-deploy"]
        await agent.aclose()


def test_a_secret_from_the_environment_is_used_and_never_printed_logged_or_traced(
    effects: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    secret = "sk-live-7f3a9c1e5b"
    monkeypatch.setenv("FAULT_TOKEN", secret)
    caplog.set_level(logging.DEBUG)
    server = stdio_server(effects, env={"MCP_TOKEN": FromEnv("FAULT_TOKEN")})
    assert secret not in repr(server) and "MCP_TOKEN" in repr(server)
    literal = MCPServer.http("http://127.0.0.1:9/mcp", headers={"X-Api-Key": "literal-key-9"})
    assert "literal-key-9" not in repr(literal) and "X-Api-Key" in repr(literal)
    with server:
        model = ScriptedModel([_call("token_digest"), "Done."])
        agent = Agent.embedded(model, system_prompt="You test.", tools=[server], memory=False)
        import asyncio  # a sync test: the agent's turn on its own loop

        asyncio.run(agent.handle("s1", "u1", "Check."))
        assert _tool_texts(agent) == [hashlib.sha256(secret.encode()).hexdigest()[:16]]
        asyncio.run(agent.aclose())
    assert secret not in caplog.text
    for database in (tmp_path / "data").rglob("*.db*"):
        assert secret.encode() not in database.read_bytes()
    with sqlite3.connect(next((tmp_path / "data").rglob("*.db"))) as db:
        assert db.execute("select count(*) from sqlite_master").fetchone()[0] > 0
    monkeypatch.delenv("FAULT_TOKEN")
    with pytest.raises(Exception, match="FAULT_TOKEN is not set"):
        stdio_server(effects, env={"MCP_TOKEN": FromEnv("FAULT_TOKEN")}).start()


def test_a_name_two_sources_share_is_refused_and_a_prefix_resolves_it(effects: Path) -> None:
    @tool
    def echo(text: str) -> str:
        """Echo locally."""
        return text

    model = ScriptedModel(["Hi."])
    clash = pytest.raises(ToolDefinitionError, match="'echo' of MCP server 'fault' clashes")
    with stdio_server(effects) as server, clash:
        Agent.embedded(model, system_prompt="You test.", tools=[echo, server], memory=False)
    with stdio_server(effects, prefix="fault_") as server:
        agent = Agent.embedded(model, system_prompt="You test.", tools=[echo, server], memory=False)
        assert {"echo", "fault_echo", "fault_write"} <= set(agent._workflow.domain_tools)
        agent.close()


async def test_an_http_server_that_restarts_is_reconnected_and_tenants_get_their_own_settings(
    effects: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_port()
    monkeypatch.setenv("ACME_TOKEN", "acme-secret-1")
    shared = MCPServer.http(f"http://127.0.0.1:{port}/mcp", name="fault-http")
    acme = shared.with_settings(headers={"Authorization": FromEnv("ACME_TOKEN", "Bearer {}")})
    assert dict(acme.headers) and not dict(shared.headers)
    assert "acme-secret-1" not in repr(acme)
    model = ScriptedModel([_call("echo", text="one"), _call("echo", text="two"), "Done."])
    with http_process(effects, port) as first, acme:
        agent = Agent.embedded(model, system_prompt="You test.", tools=[acme], memory=False)
        first.terminate()
        first.wait(timeout=30)
        with http_process(effects, port):
            # Each call finds the server restarted (a read: repeated once on the new
            # connection, never shown to the model as a failure).
            reply = await agent.handle("s1", "u1", "Echo twice.")
            assert reply.status == "completed", reply
            assert _tool_texts(agent) == ["one", "two"]
            await agent.aclose()


async def test_a_tool_gone_from_the_server_before_keel_relisted_is_a_failed_call(
    fault: MCPServer,
) -> None:
    stale = ToolExecutor(ToolRegistry(fault.tools().values()))
    assert fault.call("remove_tool", {"name": "echo"}) == "removed echo"
    call = ToolCall(id="c1", name="echo", arguments='{"text": "hi"}')
    result = await stale.execute(call, session_id="s1", step=1)
    assert result.status == "failed" and "echo" in result.content, result.content
    await _until(lambda: "echo" not in fault.tools())


async def test_a_turn_after_its_server_was_closed_offers_none_of_its_tools_and_still_answers(
    effects: Path,
) -> None:
    model = ScriptedModel(["Hello."])
    with stdio_server(effects) as server:
        agent = Agent.embedded(model, system_prompt="You test.", tools=[server], memory=False)
    reply = await agent.handle("s1", "u1", "Hi.")
    assert reply.status == "completed" and model.calls[-1].tools == ()
    await agent.aclose()


async def test_a_server_hung_at_its_listing_is_left_out_until_it_answers(
    effects: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A test before this one may have set up keel's own logging (the CLI's, the service's),
    # which stops "keel" records at its handler: caplog listens at the root.
    monkeypatch.setattr(logging.getLogger("keel"), "propagate", True)
    caplog.set_level(logging.WARNING, logger="keel")
    gate = tmp_path / "answer-now"
    model = ScriptedModel(["Hello.", _call("echo", text="back"), "Done."])
    with stdio_server(effects, list_after=gate, connect_timeout_s=0.5) as server:
        # Built while the server still withholds its listing: left out, with the reason logged.
        agent = Agent.embedded(model, system_prompt="You test.", tools=[server], memory=False)
        assert server.tools() == {}
        # The reason is logged when the wait ends with the listing still missing; a loaded
        # machine can settle the first connection in the instant the wait ends (then no
        # warning), which failed 2 full runs of 4: the outcome is what is asserted.
        first = await agent.handle("s1", "u1", "Hi.")
        assert first.status == "completed" and model.calls[-1].tools == ()
        gate.touch()
        await _until(lambda: "echo" in server.tools())
        second = await agent.handle("s1", "u1", "Echo.")
        assert second.status == "completed", second
        assert _tool_texts(agent) == ["back"]
        await agent.aclose()


async def test_a_deployment_makes_an_mcp_write_wait_for_an_operators_approval(
    effects: Path, tmp_path: Path
) -> None:
    with stdio_server(effects, tools={"write": MCPToolOverride(approval=True)}) as server:
        model = ScriptedModel([_call("write", item="refund:W1"), "Done."])
        agent = Agent.open(
            f"sqlite:///{tmp_path / 'keel.db'}",
            system_prompt="You write.",
            model=model,
            tools=[server],
            memory=False,
        )
        try:
            parked = await agent.handle("s1", "u1", "Refund W1.")
            assert parked.status == "awaiting_approval", parked
            assert _written(effects) == []  # nothing reached the server before the decision
            [waiting] = parked.approvals
            decided = await agent.decide("s1", waiting.id, approve=True, by="ops")
            assert decided.status == "completed", decided
            again = await agent.decide("s1", waiting.id, approve=True, by="ops")
            assert again.replayed
            assert _written(effects) == ["refund:W1"]  # once
        finally:
            await agent.aclose()
