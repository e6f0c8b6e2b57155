"""The PII vault with tools from an MCP server, through ``Agent.open`` on one SQLite file with
``KEEL_PII_KEY``, against keel's fault server (a real MCP server in its own process): the server
gets the user's real values (its own effects file shows them), a value the server returns goes
into the vault (the model, the state, the journal and the trace see its placeholder, and a
later call gets the value back), and a deployment keeps placeholders for a server it does not
trust (``MCPToolOverride(sees_values=False)``, ``masked_arguments``)."""

from __future__ import annotations

import json
import re
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from keel.errors import ToolDefinitionError
from keel.messages import Message
from keel.privacy import MasterKey
from keel.runtime import Agent
from keel.testing import ScriptedCall, ScriptedModel
from keel.testing.mcp_fault_server import PROFILE_PHONE, stdio_server
from keel.tools import MCPServer, MCPToolOverride, schema_tool

EMAIL = "alice.smith@example.com"
API_KEY = "sk-proj-abcdefghijklmnopqrstuvwxyz012345"


@pytest.fixture
def opened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Callable[[ScriptedModel, MCPServer], Agent]:
    monkeypatch.setenv("KEEL_PII_KEY", MasterKey.new_key_text())

    def open_agent(model: ScriptedModel, server: MCPServer) -> Agent:
        return Agent.open(
            f"sqlite:///{tmp_path / 'keel.db'}",
            model=model,
            system_prompt="You help customers.",
            tools=[server],
            memory=False,
        )

    return open_agent


@pytest.fixture
def effects(tmp_path: Path) -> Path:
    return tmp_path / "effects.txt"


def _sent(call: ScriptedCall) -> str:
    return "\n".join(
        message.content + "".join(c.arguments for c in message.tool_calls)
        for message in call.messages
    )


def _placeholder(call: ScriptedCall, entity: str) -> str:
    found = re.findall(rf"<{entity}_\d+>", _sent(call))
    assert found, f"the model was shown no {entity} placeholder"
    return found[0]


def _calling(name: str, **arguments: Callable[[ScriptedCall], str] | str) -> Any:
    def reply(call: ScriptedCall) -> Message:
        values = {k: v(call) if callable(v) else v for k, v in arguments.items()}
        return ScriptedModel.tool_call(name, json.dumps(values))

    return reply


def _rows(path: Path) -> str:
    """Every row of every table but the vault's own, as text."""
    with sqlite3.connect(path) as conn:
        tables = [
            name
            for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
            if not name.startswith("keel_pii_")
        ]
        return "\n".join(
            f"{table}: {row!r}"
            for table in tables
            for row in conn.execute(f"SELECT * FROM {table}")
        )


async def test_the_server_gets_real_values_and_what_it_returns_is_kept_as_placeholders(
    opened: Callable[[ScriptedModel, MCPServer], Agent], effects: Path, tmp_path: Path
) -> None:
    model = ScriptedModel(
        [
            _calling("write", item=lambda call: _placeholder(call, "EMAIL")),
            _calling("profile", email=lambda call: _placeholder(call, "EMAIL")),
            _calling("write", item=lambda call: _placeholder(call, "PHONE")),
            "Done.",
        ]
    )
    with stdio_server(effects) as server:
        agent = opened(model, server)
        reply = await agent.run(f"I am {EMAIL}, note me down", session="s1", user="alice")
        assert reply.status == "completed", reply
        # The server's own record: the real address, and the phone number it returned itself.
        assert effects.read_text().splitlines() == [EMAIL, PROFILE_PHONE]
        shown = "\n".join(_sent(call) for call in model.calls)
        assert EMAIL not in shown and PROFILE_PHONE not in shown
        assert "<PHONE_1>" in _sent(model.calls[2])
        state = agent.session_state("s1")
        assert state is not None
        tools = [m.content for m in state.messages if m.role == "tool"]
        assert tools[0] == "wrote <EMAIL_1>" and "<PHONE_1>" in tools[1]
        assert tools[2] == "wrote <PHONE_1>"
        rows = _rows(tmp_path / "keel.db")
        assert EMAIL not in rows and PROFILE_PHONE not in rows
        assert agent.backends is not None
        steps = agent.backends.traces.get_steps(reply.run_id)
        traced = [(s.tool_arguments, s.tool_result) for s in steps if s.kind == "tool"]
        assert traced[0] == ('{"item": "<EMAIL_1>"}', "wrote <EMAIL_1>"), traced
        assert traced[2][1] == "wrote <PHONE_1>"
        journal = "\n".join(
            repr(row)
            for row in sqlite3.connect(tmp_path / "keel.db").execute(
                "SELECT arguments, content FROM keel_tool_journal"
            )
        )
        assert "<EMAIL_1>" in journal and "wrote <PHONE_1>" in journal
        await agent.aclose()


async def test_a_deployment_keeps_placeholders_for_a_server_it_does_not_trust(
    opened: Callable[[ScriptedModel, MCPServer], Agent], effects: Path
) -> None:
    model = ScriptedModel(
        [
            _calling("write", item=lambda call: _placeholder(call, "EMAIL")),
            _calling("echo", text=lambda call: _placeholder(call, "API_KEY")),
            "Done.",
        ]
    )
    untrusted = {
        "write": MCPToolOverride(sees_values=False),
        "echo": MCPToolOverride(masked_arguments=("text",)),
    }
    with stdio_server(effects, tools=untrusted) as server:
        agent = opened(model, server)
        reply = await agent.run(f"I am {EMAIL}, key {API_KEY}", session="s1", user="alice")
        assert reply.status == "completed", reply
        assert effects.read_text().splitlines() == ["<EMAIL_1>"]
        state = agent.session_state("s1")
        assert state is not None
        # The echo server got (and so returned) the placeholder, not the key.
        assert [m.content for m in state.messages if m.role == "tool"][1] == "<API_KEY_1>"
        await agent.aclose()


async def test_a_masked_argument_the_schema_does_not_name_is_refused(effects: Path) -> None:
    async def run(arguments: dict[str, Any], context: object) -> str:
        return ""

    with pytest.raises(ToolDefinitionError, match=r"masked_arguments .*\['secret'\]"):
        schema_tool("t", "A tool.", {"properties": {"x": {}}}, run, masked_arguments=("secret",))
    wrong = {"echo": MCPToolOverride(masked_arguments=("secret",))}
    with stdio_server(effects, tools=wrong) as server:
        # Left out with its reason, as any tool keel cannot use.
        assert "echo" not in server.tools()
        assert any("secret" in problem for problem in server.problems)
