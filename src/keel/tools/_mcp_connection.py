"""One MCP server's connection, kept on its own event loop in a daemon thread.

Its own loop, because an agent's turns may run on any loop (``asyncio.run`` in a script, the
sync twins' bridge loop, a server's loop) while an MCP session belongs to the loop it was
opened on. A supervisor task holds the session: it connects, lists the tools, waits until the
connection is lost (a call saw it close) or the server is closed, and connects again with
backoff. A call hops onto that loop and back; cancelling the caller (a tool timeout) cancels
the call there.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import AsyncIterator
from typing import Any

import httpx2
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp_types import CONNECTION_CLOSED, CallToolResult

from keel.errors import KeelError, ToolDefinitionError
from keel.tools._mcp import MCPConnectionLost, MCPServer, build_tools, result_text
from keel.tools._schema_tool import SchemaTool

__all__ = ["Connection"]

logger = logging.getLogger("keel.tools.mcp")

_BACKOFF_FIRST_S = 0.1
_BACKOFF_MAX_S = 5.0


class Connection:
    """The live side of an [`MCPServer`][]: its session, its tools, its supervisor."""

    def __init__(self, server: MCPServer) -> None:
        self.server = server
        self.tools: dict[str, SchemaTool] = {}
        self.problems: list[str] = []
        self.restarts = 0
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name=f"keel-mcp-{server.name}", daemon=True
        )
        self._client: Client | None = None
        self._ready = asyncio.Event()
        self._lost = asyncio.Event()
        self._closing = False
        self._supervisor: asyncio.Task[None] | None = None
        self._first: concurrent.futures.Future[None] = concurrent.futures.Future()

    def start(self, timeout_s: float) -> None:
        """Start the loop and the supervisor; wait for the first listing, at most
        ``timeout_s``: a server that has not answered by then (hung) is left out, offering no
        tools, until its listing arrives (the supervisor keeps waiting, and reconnects).

        Raises:
            ToolDefinitionError: the server could not be reached (it failed, not hung).
        """
        self._thread.start()
        self.loop.call_soon_threadsafe(self._spawn_supervisor)
        try:
            self._first.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            # From here on a failed first connection is retried with backoff like a lost one
            # (unless the listing or the failure came in just now).
            if not self._first.cancel():
                self._settled_first()
                return
            logger.warning(
                "MCP server %r did not list its tools within %g s; its tools are left out "
                "until it does",
                self.server.name,
                timeout_s,
            )
        except Exception:
            self.close()
            raise

    def _settled_first(self) -> None:
        """The first connection's outcome, known: nothing, or it failed (closed, raised)."""
        try:
            self._first.result(timeout=0)
        except Exception:
            self.close()
            raise

    def _spawn_supervisor(self) -> None:
        self._supervisor = self.loop.create_task(self._supervise())

    def close(self) -> None:
        """Stop the supervisor (which closes the session and a stdio server) and the loop."""
        if self.loop.is_closed():
            return

        async def stop() -> None:
            self._closing = True
            if self._supervisor is not None:
                self._supervisor.cancel()
                with contextlib.suppress(BaseException):
                    await self._supervisor

        if self._thread.is_alive():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(stop(), self.loop).result(timeout=10)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()

    # --- the supervisor (on the connection's loop) --------------------------------------------

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
                    if not self._first.done():
                        with contextlib.suppress(concurrent.futures.InvalidStateError):
                            self._first.set_result(None)  # unless start() gave up just now
                    await self._lost.wait()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not self._first.done():
                    # Unless start() gave up waiting just now: then retried as a lost one.
                    with contextlib.suppress(concurrent.futures.InvalidStateError):
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
                self.loop.create_task(self._relist_after_change(client))

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
        self.tools, self.problems = build_tools(self.server, listed, self)
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
        future = asyncio.run_coroutine_threadsafe(self._call_here(name, arguments), self.loop)
        return await asyncio.wrap_future(future)

    def call_sync(self, name: str, arguments: dict[str, Any]) -> str:
        """Call ``name`` and wait, from a thread outside the connection's loop."""
        future = asyncio.run_coroutine_threadsafe(self._call_here(name, arguments), self.loop)
        return result_text(future.result(), name)


def _start_failure(server: MCPServer, exc: Exception) -> Exception:
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
