"""One MCP server's connection, kept on keel's bridge loop.

The MCP SDK ties a session to the loop it was opened on, for its whole life: its anyio task
group reads the server's messages, and it must be left from the task that entered it. An
agent's turns may run on any loop (``asyncio.run`` in a script, the sync twins' bridge loop, a
server's loop), so every session lives on the one bridge loop (`keel._bridge.on_bridge`),
the loop keel already keeps for the life of the process, rather than on a loop and a thread of
its own per server. A supervisor task there holds the session: it connects, lists the tools,
waits until the connection is lost (a call saw it close) or the server is closed, and connects
again with backoff. A call hops onto the bridge loop and back; cancelling the caller (a tool
timeout) cancels the call there.

This module knows the server only by the settings it reads (``ServerSettings``) and turns
listings into tools with the function it is given: the server's own module imports this one
(when a server starts), never the other way round.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any, Literal, Protocol

import httpx2
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp_types import CONNECTION_CLOSED, CallToolResult

from keel._bridge import on_bridge, run_sync
from keel.errors import KeelError, ToolDefinitionError
from keel.tools._schema_tool import SchemaTool

__all__ = ["Connection", "MCPConnectionLost", "ServerSettings"]

logger = logging.getLogger("keel.tools.mcp")

_BACKOFF_FIRST_S = 0.1
_BACKOFF_MAX_S = 5.0


class MCPConnectionLost(ConnectionError):
    """The server went away during a call (it is being restarted)."""


class ServerSettings(Protocol):
    """What a connection reads of its [`MCPServer`][keel.tools.MCPServer]."""

    @property
    def name(self) -> str: ...
    @property
    def transport(self) -> Literal["stdio", "http"]: ...
    @property
    def command(self) -> str | None: ...
    @property
    def args(self) -> tuple[str, ...]: ...
    @property
    def env(self) -> Mapping[str, Any]: ...
    @property
    def cwd(self) -> str | None: ...
    @property
    def url(self) -> str | None: ...
    @property
    def headers(self) -> Mapping[str, Any]: ...
    @property
    def connect_timeout_s(self) -> float: ...


MakeTools = Callable[[Sequence[Any], "Connection"], tuple[dict[str, SchemaTool], list[str]]]
"""Turns a listing into keel tools (by keel name) and the reasons any were left out."""


class Connection:
    """The live side of an [`MCPServer`][keel.tools.MCPServer]: its session, its tools, its
    supervisor, all on the bridge loop."""

    def __init__(self, server: ServerSettings, make_tools: MakeTools) -> None:
        self.server = server
        self._make_tools = make_tools
        self.tools: dict[str, SchemaTool] = {}
        self.problems: list[str] = []
        self.restarts = 0
        self._client: Client | None = None
        self._ready = asyncio.Event()
        self._lost = asyncio.Event()
        self._closing = False
        self._supervisor: asyncio.Task[None] | None = None
        self._first: asyncio.Future[None] | None = None
        self._relisting: set[asyncio.Task[None]] = set()

    async def astart(self, timeout_s: float) -> None:
        """Start the supervisor (on the bridge loop: call it there); wait for the first
        listing, at most ``timeout_s``: a server that has not answered by then (hung) is left
        out, offering no tools, until its listing arrives (the supervisor keeps waiting, and
        reconnects).

        Raises:
            ToolDefinitionError: the server could not be reached (it failed, not hung).
        """
        loop = asyncio.get_running_loop()
        first = self._first = loop.create_future()
        self._supervisor = loop.create_task(self._supervise())
        try:
            await asyncio.wait_for(asyncio.shield(first), timeout_s)
        except TimeoutError:
            # From here on a failed first connection is retried with backoff like a lost one
            # (unless the listing or the failure came in just now).
            if not first.cancel():
                failure = first.exception()
                if failure is not None:
                    await self.aclose()
                    raise failure from failure.__cause__
                return
            logger.warning(
                "MCP server %r did not list its tools within %g s; its tools are left out "
                "until it does",
                self.server.name,
                timeout_s,
            )
        except BaseException:
            await self.aclose()
            raise

    async def aclose(self) -> None:
        """Stop the supervisor (which closes the session and a stdio server); on the bridge
        loop."""
        self._closing = True
        for task in self._relisting:
            task.cancel()
        supervisor, self._supervisor = self._supervisor, None
        if supervisor is not None:
            supervisor.cancel()
            await asyncio.wait([supervisor])

    # --- the supervisor (on the bridge loop) --------------------------------------------

    async def _supervise(self) -> None:
        delay = _BACKOFF_FIRST_S
        while not self._closing:
            try:
                async with self._session() as client:
                    self._client = client
                    await self._relist(client)
                    self._lost.clear()
                    self._ready.set()
                    delay = _BACKOFF_FIRST_S
                    if self._first is not None and not self._first.done():
                        self._first.set_result(None)  # unless astart gave up waiting
                    await self._lost.wait()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if self._first is not None and not self._first.done():
                    # Unless astart gave up waiting: then retried as a lost one.
                    self._first.set_exception(_start_failure(self.server, exc))
                    return
                # The type only: a transport's message may quote a URL with credentials.
                logger.warning(
                    "MCP server %r: connection lost (%s); reconnecting in %.1f s",
                    self.server.name,
                    type(exc).__name__,
                    delay,
                )
            finally:
                self._client = None
                self._ready.clear()
            await asyncio.sleep(delay)
            delay = min(delay * 2, _BACKOFF_MAX_S)
            self.restarts += 1

    @contextlib.asynccontextmanager
    async def _session(self) -> AsyncIterator[Client]:
        server = self.server
        env = {key: _resolved(value) for key, value in server.env.items()}
        if server.transport == "stdio":
            parameters = StdioServerParameters(
                command=server.command or "",
                args=list(server.args),
                env=env or None,
                cwd=server.cwd,
            )
            # Legacy handshake: list-changed notifications arrive on the session itself.
            async with Client(
                parameters, mode="legacy", cache=None, message_handler=self._on_message
            ) as client:
                yield client
            return
        headers = {key: _resolved(value) for key, value in server.headers.items()}
        async with (
            httpx2.AsyncClient(headers=headers, timeout=server.connect_timeout_s) as http,
            Client(
                streamable_http_client(server.url or "", http_client=http),
                mode="legacy",
                cache=None,
                message_handler=self._on_message,
            ) as client,
        ):
            yield client

    async def _on_message(self, message: Any) -> None:
        if getattr(message, "method", None) == "notifications/tools/list_changed":
            client = self._client
            if client is not None:
                # Not awaited here: the session's reader is what delivers the listing.
                task = asyncio.get_running_loop().create_task(self._relist_after_change(client))
                self._relisting.add(task)
                task.add_done_callback(self._relisting.discard)

    async def _relist_after_change(self, client: Client) -> None:
        try:
            await self._relist(client)
        except Exception as exc:
            # The old listing stays; a lost connection relists when it reconnects.
            logger.warning(
                "MCP server %r: listing its changed tools failed (%s)",
                self.server.name,
                type(exc).__name__,
            )

    async def _relist(self, client: Client) -> None:
        listed: list[Any] = []
        cursor: str | None = None
        while True:
            page = await client.list_tools(cursor=cursor)
            listed.extend(page.tools)
            cursor = page.next_cursor
            if cursor is None:
                break
        self.tools, self.problems = self._make_tools(listed, self)
        logger.info("MCP server %r lists %d tools", self.server.name, len(self.tools))

    # --- calls --------------------------------------------------------------------------------

    async def _open_client(self) -> Client:
        """The session to send on: one whose server went away since the last call (a stdio
        server that exited) is replaced first, so the call is sent, not lost unsent."""
        while True:
            await self._ready.wait()
            client = self._client
            if client is not None and not _closed(client):
                return client
            self._lost.set()
            await asyncio.sleep(0.01)  # the supervisor reconnects; the caller's timeout bounds it

    async def _call_here(self, name: str, arguments: dict[str, Any]) -> CallToolResult:
        client = await self._open_client()
        try:
            return await client.call_tool(name, arguments)
        except MCPError as exc:
            if _session_unknown(exc):
                # An HTTP server that restarted refused the call before running it: send it
                # once more on a new session.
                self._lost.set()
                while self._client is client:
                    await asyncio.sleep(0.01)
                return await (await self._open_client()).call_tool(name, arguments)
            if exc.code != CONNECTION_CLOSED:
                raise  # the server answered: a protocol error, settled
            self._lost.set()
            raise MCPConnectionLost(
                f"lost its MCP server {self.server.name!r} mid-call (the connection closed)"
            ) from exc
        except (OSError, httpx2.HTTPError, EOFError) as exc:
            self._lost.set()
            raise MCPConnectionLost(
                f"lost its MCP server {self.server.name!r} mid-call ({type(exc).__name__})"
            ) from exc

    async def call(self, name: str, arguments: dict[str, Any]) -> CallToolResult:
        """Call ``name`` on the server from any loop (cancelling this cancels the call)."""
        return await on_bridge(self._call_here(name, arguments))

    def call_sync(self, name: str, arguments: dict[str, Any]) -> CallToolResult:
        """Call ``name`` and wait, from any thread but the bridge loop's."""
        return run_sync(self._call_here(name, arguments), in_running_loop=True)


def _start_failure(server: ServerSettings, exc: Exception) -> Exception:
    """What ``start`` raises when the first connection fails: a configuration error as it is,
    anything else as a ToolDefinitionError naming the server (and the cause's type only)."""
    while isinstance(exc, ExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    if isinstance(exc, KeelError):
        return exc
    # A stdio failure names the command; an HTTP one only its type (a URL may hold secrets).
    detail = f"{type(exc).__name__}: {exc}" if server.transport == "stdio" else type(exc).__name__
    failure = ToolDefinitionError(
        f"MCP server {server.name!r} could not be started or listed ({detail})"
    )
    failure.__cause__ = exc
    return failure


def _session_unknown(error: MCPError) -> bool:
    """The streamable-HTTP server does not know the session (it restarted): the request was
    refused at the door, so nothing ran."""
    message = str(error.message if hasattr(error, "message") else error).lower()
    return "session not found" in message or "session terminated" in message


def _closed(client: Client) -> bool:
    """Whether the session's transport has closed (its reader saw the server go)."""
    # A private flag of the SDK's dispatcher: the only sign of a stdio server that exited
    # between calls; a dispatcher without it reads as open (the call then finds out).
    dispatcher = getattr(client.session, "_dispatcher", None)
    return bool(getattr(dispatcher, "_closed", False))


def _resolved(value: Any) -> str:
    return value if isinstance(value, str) else str(value.resolve())
