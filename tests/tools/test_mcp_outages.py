"""An MCP server that goes away, through the Agent, counted from the server's own data (the items
its ``write`` tool received, in a file it appends to): a call that never left keel is a plain
failure, "not run", never in doubt; a server killed before a call is noticed before the call is
sent (it is restarted and the call sent once); a server that crashes at start-up is left out like
one that hangs, with its exit code and its last stderr lines (secrets masked) in the warning.
Against a small stdio server written here with the ``mcp`` SDK, keel's fault server over HTTP,
and the third-party ``@modelcontextprotocol/server-everything``."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from keel.messages import Message
from keel.runtime import Agent
from keel.testing import ScriptedModel
from keel.testing.mcp_fault_server import http_process
from keel.testing.servers import free_port
from keel.tools import MCPServer
from tests.tools.test_mcp_servers import EVERYTHING, NODE, needs_everything

SECRET = "sk-live-7f3a9c1e5b8d2a4f6e0c"

# The server: ``write`` appends each item it receives to HOME/received.txt; with HOME/broken it
# exits at once with code 3 and a line on stderr (a server that cannot start); with HOME/hang it
# never answers; with HOME/helper
# it first starts a helper process that inherits its stdin and stdout and keeps them open
# after the server dies (so keel's reader sees no end of file).
SERVER = f"""
import os, subprocess, sys
from pathlib import Path

home = Path(sys.argv[1])
if (home / "broken").exists():
    print("starting the outage server", file=sys.stderr)
    print("fatal: the database refused token {SECRET}", file=sys.stderr, flush=True)
    sys.exit(3)
if (home / "hang").exists():
    import signal

    signal.pause()  # started, never answers (a server hung at start-up)
if (home / "helper").exists():
    helper = subprocess.Popen(["sleep", "300"])
    (home / "helper.pid").write_text(str(helper.pid))

from mcp.server.mcpserver import MCPServer

server = MCPServer("outage")


@server.tool()
def write(item: str) -> str:
    \"\"\"Record an item (a side effect).\"\"\"
    with open(home / "received.txt", "a", encoding="utf-8") as out:
        out.write(item + "\\n")
        out.flush()
        os.fsync(out.fileno())
    return "wrote " + item


server.run()
"""


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Path]:
    (tmp_path / "server.py").write_text(SERVER, encoding="utf-8")
    yield tmp_path
    helper = tmp_path / "helper.pid"
    if helper.exists():  # a helper the server left behind
        with contextlib.suppress(psutil.NoSuchProcess):
            psutil.Process(int(helper.read_text())).kill()


def _server(home: Path, **options: object) -> MCPServer:
    return MCPServer.stdio(
        sys.executable, [str(home / "server.py"), str(home)], name="outage", **options
    )


def _received(home: Path) -> list[str]:
    path = home / "received.txt"
    return path.read_text(encoding="utf-8").splitlines() if path.exists() else []


def _call(tool_name: str, **arguments: object) -> Message:
    return ScriptedModel.tool_call(tool_name, json.dumps(arguments))


def _tool_texts(agent: Agent, session: str = "s1") -> list[str]:
    state = agent.session_state(session)
    assert state is not None
    return [message.content for message in state.messages if message.role == "tool"]


def _kill_server(home: Path) -> None:
    """SIGKILL the running server (only it, not a helper of its) and wait until it has exited."""
    [server] = [
        child
        for child in psutil.Process().children(recursive=True)
        if str(home / "server.py") in child.cmdline()
    ]
    exited = os.pidfd_open(server.pid)  # readable once the process has exited
    try:
        server.kill()
        select.select([exited], [], [])
    finally:
        os.close(exited)


async def test_a_write_while_the_server_is_down_and_cannot_restart_is_not_run_not_in_doubt(
    home: Path,
) -> None:
    # The write's limit is long: a call that waited for it would be reported in doubt.
    server = _server(home, timeout_s=20)
    write = _call("write", item="refund:W1")
    model = ScriptedModel([write, "It failed.", write, "Done."])
    async with server:
        agent = Agent.embedded(model, system_prompt="You write.", tools=[server], memory=False)
        (home / "broken").touch()  # every restart fails from now on
        _kill_server(home)
        first = await agent.handle("s1", "u1", "Refund W1.")
        assert first.status == "completed", first
        [failed] = _tool_texts(agent)
        assert "MCP server 'outage' is unavailable" in failed and "not run" in failed, failed
        assert "exited with code 3" in failed and SECRET not in failed, failed
        assert _received(home) == []
        journal = agent.journal
        assert journal is not None and journal.in_doubt() == []  # nothing for an operator
        [entry] = journal.entries()
        assert entry.status == "failed" and "not run" in (entry.content or "")
        # The server is back: the same call runs (a failure that was not run is no doubt).
        (home / "broken").unlink()
        second = await agent.handle("s1", "u1", "Try again.")
        assert second.status == "completed", second
        assert _tool_texts(agent)[-1] == "wrote refund:W1"
        assert _received(home) == ["refund:W1"] and journal.in_doubt() == []
        await agent.aclose()


async def test_a_write_to_an_http_server_that_is_down_is_not_run_not_in_doubt(
    home: Path,
) -> None:
    effects = home / "effects.txt"
    port = free_port()
    server = MCPServer.http(f"http://127.0.0.1:{port}/mcp", name="fault-http", timeout_s=20)
    model = ScriptedModel([_call("write", item="refund:W5"), "It failed."])
    with http_process(effects, port) as process:
        async with server:
            agent = Agent.embedded(model, system_prompt="You write.", tools=[server], memory=False)
            process.terminate()
            process.wait(timeout=30)  # down, and nothing listens on its port any more
            reply = await agent.handle("s1", "u1", "Refund W5.")
            assert reply.status == "completed", reply
            [failed] = _tool_texts(agent)
            assert "MCP server 'fault-http' is unavailable" in failed, failed
            assert "not run" in failed, failed
            journal = agent.journal
            assert journal is not None and journal.in_doubt() == []
            await agent.aclose()
    assert not effects.exists()


async def test_a_server_killed_before_a_write_is_restarted_and_the_write_sent_once(
    home: Path,
) -> None:
    # The helper keeps the dead server's pipes open: keel's reader sees no end of file, and
    # only the process's exit says the server is gone.
    (home / "helper").touch()
    server = _server(home, timeout_s=20)
    model = ScriptedModel([_call("write", item="refund:W2"), "Done."])
    async with server:
        agent = Agent.embedded(model, system_prompt="You write.", tools=[server], memory=False)
        _kill_server(home)
        reply = await agent.handle("s1", "u1", "Refund W2.")
        assert reply.status == "completed", reply
        assert _tool_texts(agent) == ["wrote refund:W2"]
        assert _received(home) == ["refund:W2"]  # sent once, to the restarted server
        journal = agent.journal
        assert journal is not None and journal.in_doubt() == []
        await agent.aclose()


async def test_a_write_still_unsent_at_its_timeout_while_the_server_hangs_is_not_run(
    home: Path,
) -> None:
    server = _server(home, timeout_s=2)  # the limit the call waits within, for the restart
    model = ScriptedModel([_call("write", item="refund:W4"), "It failed."])
    async with server:
        agent = Agent.embedded(model, system_prompt="You write.", tools=[server], memory=False)
        (home / "hang").touch()  # the restarted server never answers
        _kill_server(home)
        reply = await agent.handle("s1", "u1", "Refund W4.")
        assert reply.status == "completed", reply
        [failed] = _tool_texts(agent)
        assert "was not run: it could not be sent within 2 s" in failed, failed
        assert _received(home) == []
        journal = agent.journal
        assert journal is not None and journal.in_doubt() == []
        await agent.aclose()


@pytest.fixture
def warnings(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> pytest.LogCaptureFixture:
    # keel's own logging, set up by an earlier test (the CLI's), stops "keel" records at its
    # handler: caplog listens at the root.
    monkeypatch.setattr(logging.getLogger("keel"), "propagate", True)
    caplog.set_level(logging.WARNING, logger="keel")
    return caplog


async def test_a_server_that_crashes_at_start_up_is_left_out_with_its_exit_code_and_stderr(
    home: Path, warnings: pytest.LogCaptureFixture
) -> None:
    (home / "broken").touch()
    server = _server(home)
    model = ScriptedModel(["Hello.", _call("write", item="refund:W3"), "Done."])
    agent = Agent.embedded(model, system_prompt="You write.", tools=[server], memory=False)
    first = await agent.handle("s1", "u1", "Hi.")  # built and answered, without its tools
    assert first.status == "completed", first
    assert model.calls[-1].tools == ()
    said = warnings.text
    assert "MCP server 'outage' exited with code 3" in said, said
    assert "fatal: the database refused token" in said and SECRET not in said, said
    # It is retried: once it starts, its tools are offered.
    (home / "broken").unlink()
    await _until(lambda: "write" in server.tools())
    second = await agent.handle("s1", "u1", "Refund W3.")
    assert second.status == "completed", second
    assert _received(home) == ["refund:W3"]
    await agent.aclose()


@needs_everything
async def test_server_everything_that_exits_at_start_up_is_left_out_with_its_reason(
    warnings: pytest.LogCaptureFixture,
) -> None:
    server = MCPServer.stdio(NODE or "node", [str(EVERYTHING), "no-such-transport"], name="every")
    agent = Agent.embedded(
        ScriptedModel(["Hello."]), system_prompt="You test.", tools=[server], memory=False
    )
    reply = await agent.handle("s1", "u1", "Hi.")
    assert reply.status == "completed", reply
    said = warnings.text
    assert "MCP server 'every' exited with code 1" in said, said
    assert "Unknown transport: no-such-transport" in said, said
    await agent.aclose()


async def _until(condition: object) -> None:
    import asyncio  # only this helper polls: the server's restart is on keel's backoff

    for _ in range(800):
        if callable(condition) and condition():
            return
        await asyncio.sleep(0.025)
    raise AssertionError("the condition never held")
