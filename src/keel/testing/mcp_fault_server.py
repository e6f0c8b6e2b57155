"""An MCP server that misbehaves on request, for keel's MCP tests and ``keel bench mcp``.

``python -m keel.testing.mcp_fault_server EFFECTS_FILE [--http PORT] [--list-after FILE]``:
stdio by default, streamable HTTP on 127.0.0.1:PORT with ``--http``; with ``--list-after``,
it answers ``tools/list`` only once FILE exists (hung at start-up). Its effects are lines
appended to ``EFFECTS_FILE`` (flushed and fsynced before the tool answers), so a test counts
what really happened from the server's side, across its restarts.

Tools: ``echo`` (read-only), ``profile`` (read-only: a customer record for an address, with
a phone number the client has never seen), ``write`` (unannotated: side-effecting, not
idempotent; an item ``crash:...`` exits the process after applying it, ``hang:...`` never
answers after applying it, ``slow:...`` answers after 30 s), ``count`` (read-only: effects so
far), ``huge`` (read-only: that many characters), ``fail`` (an ``isError`` result), ``hang``
(read-only, never answers), ``token_digest`` (read-only: a digest of ``MCP_TOKEN``, never the
token), ``header_digest`` (read-only: a digest of an HTTP header the call came with),
``add_tool`` / ``remove_tool`` (change the listing and say so), and ``bad_schema`` (listed with
a malformed JSON schema).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import ToolAnnotations

from keel.tools import MCPServer as KeelMCPServer

READ_ONLY = ToolAnnotations(read_only_hint=True, idempotent_hint=True)

PROFILE_PHONE = "+1 415 555 0198"
"""The phone number ``profile`` returns: a value only the server knew."""


def build(effects: Path, list_after: Path | None = None) -> MCPServer:
    """The server, its effects appended to ``effects``; with ``list_after``, a ``tools/list``
    is answered only once that file exists (a server hung at start-up, then recovered)."""
    server = MCPServer("keel-fault")
    if list_after is not None:
        _gate_listing(server, list_after)

    def applied(item: str) -> None:
        with effects.open("a", encoding="utf-8") as out:
            out.write(item + "\n")
            out.flush()
            os.fsync(out.fileno())

    @server.tool(annotations=READ_ONLY)
    def echo(text: str) -> str:
        """Return the text."""
        return text

    @server.tool(annotations=READ_ONLY)
    def profile(email: str) -> str:
        """The customer record of an e-mail address."""
        return f'{{"email": "{email}", "phone": "{PROFILE_PHONE}"}}'

    @server.tool()
    async def write(item: str) -> str:
        """Record an item (a side effect)."""
        applied(item)
        if item.startswith("crash:"):
            os._exit(3)
        if item.startswith("hang:"):
            await asyncio.Event().wait()
        if item.startswith("slow:"):
            await asyncio.sleep(30)
        return f"wrote {item}"

    @server.tool(annotations=READ_ONLY)
    def count() -> int:
        """How many items were written."""
        return len(effects.read_text(encoding="utf-8").splitlines()) if effects.exists() else 0

    @server.tool(annotations=READ_ONLY)
    def huge(chars: int) -> str:
        """Return that many characters."""
        return "x" * chars

    @server.tool(annotations=READ_ONLY)
    def fail(reason: str) -> str:
        """Fail with the reason."""
        raise ToolError(reason)

    @server.tool(annotations=READ_ONLY)
    async def hang() -> str:
        """Never answer."""
        await asyncio.Event().wait()
        return "never"

    @server.tool(annotations=READ_ONLY)
    def token_digest() -> str:
        """A digest of the MCP_TOKEN this server was given."""
        token = os.environ.get("MCP_TOKEN", "")
        return hashlib.sha256(token.encode()).hexdigest()[:16]

    @server.tool(annotations=READ_ONLY)
    def header_digest(name: str, ctx: Context) -> str:
        """A digest of the HTTP header this call came with (over streamable HTTP)."""
        request = ctx.request_context.request
        headers = getattr(request, "headers", None)
        value = "" if headers is None else headers.get(name, "")
        return hashlib.sha256(value.encode()).hexdigest()[:16]

    @server.tool()
    async def add_tool(name: str, ctx: Context) -> str:
        """Add a read-only tool that returns its name, and tell the client."""

        def added() -> str:
            return name

        server.add_tool(added, name=name, description=f"The added tool {name}.")
        await ctx.session.send_tool_list_changed()
        return f"added {name}"

    @server.tool()
    async def remove_tool(name: str, ctx: Context) -> str:
        """Remove a tool, and tell the client."""
        server.remove_tool(name)
        await ctx.session.send_tool_list_changed()
        return f"removed {name}"

    @server.tool(annotations=READ_ONLY)
    def bad_schema(x: str) -> str:
        """Listed with a schema no validator accepts."""
        return x

    # A malformed schema, as a buggy server would list it.
    server._tool_manager._tools["bad_schema"].parameters = {
        "type": "object",
        "properties": {"x": {"type": "no-such-type"}},
    }
    return server


def _gate_listing(server: MCPServer, gate: Path) -> None:
    listed = server.list_tools

    async def list_when_open() -> Any:
        while not gate.exists():
            await asyncio.sleep(0.05)
        return await listed()

    # The SDK's handler looks list_tools up on the instance at each request.
    setattr(server, "list_tools", list_when_open)  # noqa: B010


def main(argv: list[str]) -> None:
    effects, options = Path(argv[0]), dict(zip(argv[1::2], argv[2::2], strict=False))
    server = build(effects, Path(options["--list-after"]) if "--list-after" in options else None)
    if "--http" in options:
        server.run("streamable-http", host="127.0.0.1", port=int(options["--http"]))
    else:
        server.run()


if __name__ == "__main__":
    main(sys.argv[1:])


@contextlib.contextmanager
def http_process(effects: Path, port: int) -> Iterator[subprocess.Popen[bytes]]:
    """This server over streamable HTTP on 127.0.0.1:``port``, in its own process, once it
    answers; stopped at the end."""
    process = subprocess.Popen(
        [sys.executable, "-m", "keel.testing.mcp_fault_server", str(effects), "--http", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while not _answers(port):
            if process.poll() is not None:
                raise RuntimeError("the fault server exited")
            if time.monotonic() > deadline:
                raise RuntimeError("the fault server did not start")
            time.sleep(0.1)
        yield process
    finally:
        process.terminate()
        process.wait(timeout=30)


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def stdio_server(effects: Path, **options: Any) -> KeelMCPServer:
    """This server as keel's [`MCPServer`][keel.tools.MCPServer] over stdio, run by this Python on
    this process's ``PYTHONPATH`` (so a checkout's keel serves, not an installed one)."""
    env = {"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ else {}
    list_after = options.pop("list_after", None)
    gate = [] if list_after is None else ["--list-after", str(list_after)]
    return KeelMCPServer.stdio(
        sys.executable,
        ["-m", "keel.testing.mcp_fault_server", str(effects), *gate],
        name=options.pop("name", "fault"),
        env={**env, **options.pop("env", {})},
        **options,
    )
