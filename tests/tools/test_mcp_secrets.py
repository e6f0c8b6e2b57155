"""A secret header from the environment (``FromEnv``) reaches a streamable-HTTP MCP server (the
fault server answers with a digest of what it got) through ``Agent.open`` on SQLite, and appears
in no log record (every logger at DEBUG), trace, journal, state, database file or ``repr``."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import pytest

from keel.runtime import Agent
from keel.testing import ScriptedModel
from keel.testing.mcp_fault_server import http_process
from keel.testing.servers import free_port
from keel.tools import FromEnv, MCPServer

SECRET = "sk-live-http-5e0c2d9a77"


def _digest(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()[:16]


async def test_a_header_from_the_environment_reaches_the_server_and_nowhere_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CRM_TOKEN", SECRET)
    caplog.set_level(logging.DEBUG)
    port = free_port()
    model = ScriptedModel(
        [
            ScriptedModel.tool_call("header_digest", json.dumps({"name": "authorization"})),
            ScriptedModel.tool_call("write", json.dumps({"item": "ticket-1"})),
            "Done.",
        ]
    )
    server = MCPServer.http(
        f"http://127.0.0.1:{port}/mcp",
        name="crm",
        headers={"Authorization": FromEnv("CRM_TOKEN", template="Bearer {}")},
    )
    with http_process(tmp_path / "effects.txt", port), server:
        agent = Agent.open(
            f"sqlite:///{tmp_path / 'keel.db'}",
            model=model,
            system_prompt="You file tickets.",
            tools=[server],
            memory=False,
        )
        reply = await agent.run("File it.", session="s1", user="u1")
        assert reply.status == "completed", reply
        state = agent.session_state("s1")
        assert state is not None
        tool_texts = [m.content for m in state.messages if m.role == "tool"]
        # The server got the header, as the template made it.
        assert tool_texts[0] == _digest(f"Bearer {SECRET}")
        assert agent.backends is not None
        steps = agent.backends.traces.get_steps(reply.run_id)
        traced = [step.model_dump_json() for step in steps]
        assert traced and not any(SECRET in text for text in traced)
        assert SECRET not in state.model_dump_json()
        assert SECRET not in repr(server) and SECRET not in repr(agent)
        await agent.aclose()
    assert (tmp_path / "effects.txt").read_text().splitlines() == ["ticket-1"]
    assert caplog.records, "nothing was logged: the check below would prove nothing"
    assert SECRET not in caplog.text
    assert not any(SECRET in str(record.__dict__) for record in caplog.records)
    files = [path for path in tmp_path.rglob("*") if path.is_file()]
    assert any(path.name.startswith("keel.db") for path in files)
    for path in files:
        assert SECRET.encode() not in path.read_bytes(), path
