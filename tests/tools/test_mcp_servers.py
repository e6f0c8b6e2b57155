"""Tools from MCP servers no one here wrote, through the Agent: the reference ``mcp-server-git``
(PyPI, stdio) makes real commits on a scratch repository, ``@modelcontextprotocol/
server-everything`` (npm, installed by setup.sh) answers over stdio and streamable HTTP, and
keel's own ``keel mcp`` memory server serves another agent its memory."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from keel.messages import Message
from keel.runtime import Agent
from keel.testing import ScriptedModel
from keel.testing.servers import free_port
from keel.tools import MCPServer, MCPToolOverride

ROOT = Path(__file__).resolve().parents[2]
EVERYTHING = ROOT / ".venv/npm/node_modules/@modelcontextprotocol/server-everything/dist/index.js"
NODE = shutil.which("node")
needs_everything = pytest.mark.skipif(
    NODE is None or not EVERYTHING.exists(),
    reason="node or @modelcontextprotocol/server-everything is missing (./setup.sh installs it "
    "into .venv/npm when npm exists)",
)


def _call(tool_name: str, **arguments: object) -> Message:
    return ScriptedModel.tool_call(tool_name, json.dumps(arguments))


def _tool_texts(agent: Agent) -> list[str]:
    state = agent.session_state("s1")
    assert state is not None
    return [message.content for message in state.messages if message.role == "tool"]


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=repo, check=True, capture_output=True, text=True
    ).stdout


async def test_mcp_server_git_commits_for_real_through_the_agent(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    _git(repo, "config", "user.email", "agent@example.com")
    _git(repo, "config", "user.name", "Agent")
    (repo / "notes.txt").write_text("first note\n")
    git_server = shutil.which("mcp-server-git") or str(
        Path(sys.executable).parent / "mcp-server-git"
    )
    # The repository is the deployment's choice: injected, never the model's.
    pinned = MCPToolOverride(inject={"repo_path": str(repo)})
    server = MCPServer.stdio(
        git_server,
        ["--repository", str(repo)],
        name="git",
        tools=dict.fromkeys(("git_add", "git_commit", "git_status", "git_log"), pinned),
    )
    with server:
        tools = server.tools()
        assert tools["git_commit"].side_effect and not tools["git_commit"].idempotent
        assert not tools["git_status"].side_effect
        assert "repo_path" not in tools["git_commit"].parameters_schema()["properties"]
        model = ScriptedModel(
            [
                _call("git_add", files=["notes.txt"]),
                _call("git_commit", message="Add the first note"),
                _call("git_log", max_count=5),
                "Committed.",
            ]
        )
        agent = Agent.embedded(model, system_prompt="You keep notes.", tools=[server], memory=False)
        reply = await agent.handle("s1", "u1", "Commit my notes.")
        assert reply.status == "completed", reply
        log = _tool_texts(agent)[-1]
        assert "Add the first note" in log
        await agent.aclose()
    assert _git(repo, "log", "--format=%s").splitlines() == ["Add the first note"]
    assert _git(repo, "show", "--name-only", "--format=").split() == ["notes.txt"]


async def _everything_through_an_agent(server: MCPServer) -> list[str]:
    with server:
        tools = server.tools()
        assert {"echo", "get-sum"} <= set(tools)
        assert not tools["get-sum"].side_effect
        assert tools["toggle-simulated-logging"].side_effect
        model = ScriptedModel(
            [
                _call("echo", message="hello"),
                _call("get-sum", a=2, b="40"),
                _call("get-sum", a=1),
                "Done.",
            ]
        )
        agent = Agent.embedded(model, system_prompt="You test.", tools=[server], memory=False)
        reply = await agent.handle("s1", "u1", "Go.")
        assert reply.status == "completed", reply
        texts = _tool_texts(agent)
        await agent.aclose()
        return texts


@needs_everything
async def test_server_everything_over_stdio() -> None:
    server = MCPServer.stdio(NODE or "node", [str(EVERYTHING), "stdio"], name="everything")
    echoed, summed, invalid = await _everything_through_an_agent(server)
    assert "hello" in echoed and "42" in summed
    assert "Field 'b': Field required" in invalid


@pytest.fixture
def everything_http() -> Iterator[str]:
    port = free_port()
    process = subprocess.Popen(
        [NODE or "node", str(EVERYTHING), "streamableHttp"],
        env={**os.environ, "PORT": str(port)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}/mcp"
    deadline = time.monotonic() + 60
    while True:
        assert process.poll() is None
        try:
            httpx.get(f"http://127.0.0.1:{port}/", timeout=1)
            break
        except httpx.HTTPError:
            assert time.monotonic() < deadline, "server-everything did not start"
            time.sleep(0.1)
    try:
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


@needs_everything
async def test_server_everything_over_streamable_http(everything_http: str) -> None:
    server = MCPServer.http(everything_http, name="everything", headers={"X-Tenant": "acme"})
    echoed, summed, _ = await _everything_through_an_agent(server)
    assert "hello" in echoed and "42" in summed


async def test_keel_mcp_serves_one_agent_the_memory_of_another_deployment(tmp_path: Path) -> None:
    env = {
        "KEEL_DATA_DIR": str(tmp_path / "other"),
        "KEEL_EMBEDDER": "hashing:64",
        "KEEL_DATABASE": f"sqlite:///{tmp_path / 'other.db'}",
        "PYTHONPATH": os.environ.get("PYTHONPATH", str(ROOT / "src")),
    }
    user = MCPToolOverride(inject={"user": "u1"})
    memory = MCPServer.stdio(
        sys.executable,
        ["-m", "keel", "mcp", "--tenant", "acme"],
        env=env,
        name="memory",
        tools={"remember": user, "search": user, "get": user, "forget": user},
    )
    with memory:
        model = ScriptedModel(
            [
                _call("remember", text="Prefers aisle seats"),
                _call("search", query="aisle seats"),
                "Noted.",
            ]
        )
        agent = Agent.embedded(model, system_prompt="You book.", tools=[memory], memory=False)
        reply = await agent.handle("s1", "u1", "I like aisle seats.")
        assert reply.status == "completed", reply
        remembered, found = _tool_texts(agent)
        assert "Prefers aisle seats" in remembered and "Prefers aisle seats" in found
        await agent.aclose()
