"""One MCP server's connection, kept on keel's bridge loop.

The MCP SDK ties a session to the loop it was opened on, for its whole life: its anyio task
group reads the server's messages, and it must be left from the task that entered it. An
agent's turns may run on any loop (``asyncio.run`` in a script, the sync twins' bridge loop, a
server's loop), so every session lives on the one bridge loop (`keel._bridge.on_bridge`),
the loop keel already keeps for the life of the process, rather than on a loop and a thread of
its own per server. A supervisor task there holds the session: it connects, lists the tools,
waits until the connection is lost (a call found the server gone) or the server is closed, and
connects again with backoff. A call hops onto the bridge loop and back; cancelling the caller
(a tool timeout) cancels the call there.

What may be in doubt is only a call written to a live server (the stdio transport,
`keel.tools._mcp_stdio`, says which): a call that finds its server gone waits for the next
connection attempt (made at once) and is sent there, or fails as not run
([`MCPServerUnavailable`][]) if that attempt fails.

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
from keel.errors import KeelError, ToolDefinitionError, ToolNotRunError
from keel.privacy import mask_pii
from keel.tools._mcp_stdio import (
    NotSent,
    Outgoing,
    SendGate,
    StdioProcess,
    outgoing,
    stdio_transport,
)
from keel.tools._schema_tool import SchemaTool

__all__ = ["Connection", "MCPConnectionLost", "MCPServerUnavailable", "ServerSettings"]

logger = logging.getLogger("keel.tools.mcp")

_BACKOFF_FIRST_S = 0.1
_BACKOFF_MAX_S = 5.0


_SEND_TRIES = 3
"""How many connections a call is tried on when its request could not be written (the server
had gone): each one a restart."""


class MCPConnectionLost(ConnectionError):
    """The server went away during a call (it is being restarted)."""


class MCPServerUnavailable(ToolNotRunError):
    """The server was down and could not be restarted (or reconnected) for a call, which was
    therefore never sent: a plain failure, not in doubt."""


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
        self.left_out: str | None = None
        """Why the first connection failed (an exit code, the last stderr lines), while no
        later one has listed the tools; None once listed."""
        self._client: Client | None = None
        self._process: StdioProcess | None = None
        self._secrets: list[str] = []
        self._ready = asyncio.Event()
        self._lost = asyncio.Event()
        self._wanted = asyncio.Event()
        self._waiting: list[asyncio.Future[str | None]] = []
        self._closing = False
        self._supervisor: asyncio.Task[None] | None = None
        self._first: asyncio.Future[None] | None = None
        self._relisting: set[asyncio.Task[None]] = set()

    async def astart(self, timeout_s: float) -> None:
        """Start the supervisor (on the bridge loop: call it there); wait for the first
        listing, at most ``timeout_s``. A server that is down at start-up, hung (no listing by
        then) or failed (it exited, refused the connection, broke the handshake), is left out,
        offering no tools, with the reason logged: the supervisor keeps reconnecting with
        backoff, and its tools appear once it lists them.

        Raises:
            ToolDefinitionError: the server is misconfigured: its command could not be
                started at all.
            ConfigError: a [`FromEnv`][keel.tools.FromEnv] value is not set.
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
        self._settle("was closed")

    # --- the supervisor (on the bridge loop) --------------------------------------------

    async def _supervise(self) -> None:
        delay = _BACKOFF_FIRST_S
        while not self._closing:
            self._wanted.clear()
            connected = False
            try:
                async with self._session() as client:
                    self._client = client
                    await self._relist(client)
                    self._lost.clear()
                    self._ready.set()
                    connected = True
                    delay = _BACKOFF_FIRST_S
                    self.left_out = None
                    self._settle(None)
                    if self._first is not None and not self._first.done():
                        self._first.set_result(None)  # unless astart gave up waiting
                    await self._lost.wait()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                cause = _root(exc)
                starting = self._first is not None and not self._first.done()
                if starting and isinstance(cause, KeelError):
                    # Misconfigured (a command that cannot run, an unset secret): no retry.
                    assert self._first is not None
                    self._first.set_exception(_start_failure(self.server, exc))
                    self._settle(self._why(cause))
                    return
                why = self._why(cause)
                if not connected:
                    self._settle(why)  # the calls waiting for this attempt are not sent
                if starting:
                    assert self._first is not None
                    self.left_out = f"{why} before listing its tools{self._said()}"
                    self._first.set_result(None)  # left out, not fatal: retried below
                    logger.warning(
                        "MCP server %r %s before listing its tools; its tools are left out "
                        "until it does (retried with backoff)%s",
                        self.server.name,
                        why,
                        self._said(),
                    )
                else:
                    logger.warning(
                        "MCP server %r: %s; reconnecting in %.1f s%s",
                        self.server.name,
                        why,
                        delay,
                        self._said(),
                    )
            else:
                if not self._closing and self._process_exit() is not None:
                    # Found gone by a call (or by its own reader): said, with its last words.
                    logger.warning(
                        "MCP server %r %s; restarting%s",
                        self.server.name,
                        self._process_exit(),
                        self._said(),
                    )
            finally:
                self._client = None
                self._ready.clear()
            # Backoff, cut short by a call that wants the server now.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wanted.wait(), delay)
            delay = min(delay * 2, _BACKOFF_MAX_S)
            self.restarts += 1

    def _settle(self, failure: str | None) -> None:
        """Tell the calls waiting for a connection how the attempt went (None: connected)."""
        waiting, self._waiting = self._waiting, []
        self._wanted.clear()  # wanted again by a call that comes after this attempt
        for waiter in waiting:
            if not waiter.done():
                waiter.set_result(failure)

    def _why(self, cause: BaseException) -> str:
        """Why the server is not connected, for a warning and a failed call: the exit code of
        a stdio server that exited, else the error's type (a message may quote a URL with
        credentials)."""
        exited = self._process_exit()
        if exited is not None:
            return exited
        if isinstance(cause, KeelError):
            return str(cause).removeprefix(f"MCP server {self.server.name!r} ")
        return f"could not be reached ({type(cause).__name__})"

    def _process_exit(self) -> str | None:
        """How a stdio server's process ended, if it ended by itself."""
        process = self._process
        code = None if process is None else process.exit_code
        if code is None:
            return None
        return f"exited with code {code}" if code >= 0 else f"was killed by signal {-code}"

    def _said(self) -> str:
        """The stdio server's last stderr lines, masked, for a warning ('' if none)."""
        process = self._process
        lines = process.stderr_tail() if process is not None else []
        if not lines:
            return ""
        return "; its last stderr lines: " + " | ".join(self._masked(line) for line in lines)

    def _masked(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return mask_pii(text)

    @contextlib.asynccontextmanager
    async def _session(self) -> AsyncIterator[Client]:
        server = self.server
        env = {key: _resolved(value) for key, value in server.env.items()}
        headers = {key: _resolved(value) for key, value in server.headers.items()}
        # What the server's stderr might echo, kept out of warnings.
        self._secrets = [v for v in (*env.values(), *headers.values()) if len(v) >= 4]
        if server.transport == "stdio":
            parameters = StdioServerParameters(
                command=server.command or "",
                args=list(server.args),
                env=env or None,
                cwd=server.cwd,
            )
            # Legacy handshake: list-changed notifications arrive on the session itself.
            async with Client(
                stdio_transport(server.name, parameters, self._spawned),
                mode="legacy",
                cache=None,
                message_handler=self._on_message,
            ) as client:
                yield client
            return
        async with (
            httpx2.AsyncClient(
                headers=headers,
                timeout=server.connect_timeout_s,
                transport=_ConnectingTransport(httpx2.AsyncHTTPTransport()),
            ) as http,
            Client(
                _marking(streamable_http_client(server.url or "", http_client=http)),
                mode="legacy",
                cache=None,
                message_handler=self._on_message,
            ) as client,
        ):
            yield client

    def _spawned(self, process: StdioProcess) -> None:
        self._process = process

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

    def _alive(self, client: Client) -> bool:
        """Whether the session can carry a call: for a stdio server, its process has not
        exited nor closed its output (by the exit status, not by whether the session's reader
        has seen the end of the pipe yet)."""
        if client is not self._client or self._lost.is_set():
            return False  # being replaced
        process = self._process
        return not (self.server.transport == "stdio" and process is not None and process.gone())

    async def _open_client(self) -> Client:
        """The session to send on. A server that went away since the last call is restarted
        (or reconnected) first, at once; if that attempt fails, the call is not sent.

        Raises:
            MCPServerUnavailable: the server is down and the attempt to bring it back failed.
        """
        while True:
            client = self._client
            if client is not None and self._ready.is_set():
                if self._alive(client):
                    return client
                self._lost.set()  # the supervisor closes it and connects again
            if self._closing:
                raise MCPServerUnavailable(f"MCP server {self.server.name!r} is closed")
            waiter: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
            self._waiting.append(waiter)
            self._wanted.set()
            failure = await waiter
            if failure is not None:
                raise MCPServerUnavailable(
                    f"MCP server {self.server.name!r} is unavailable (it {failure})"
                )

    async def _call_here(
        self, name: str, arguments: dict[str, Any], gate: SendGate | None
    ) -> CallToolResult:
        for _ in range(_SEND_TRIES):
            client = await self._open_client()
            sending = Outgoing(gate=gate)
            token = outgoing.set(sending)  # the request this task writes is the call's
            try:
                return await client.call_tool(name, arguments)
            except NotSent:
                self._lost.set()  # never written: restart the server and send it there
                _not_sent(sending)
                continue
            except MCPError as exc:
                if _session_unknown(exc):
                    # An HTTP server that restarted refused the call before running it: send
                    # it once more on a new session.
                    self._lost.set()
                    continue
                if exc.code != CONNECTION_CLOSED:
                    raise  # the server answered: a protocol error, settled
                self._lost.set()
                if not sending.written:
                    _not_sent(sending)
                    continue  # closed before the request went out
                raise MCPConnectionLost(
                    f"lost its MCP server {self.server.name!r} mid-call (the connection closed)"
                ) from exc
            except (OSError, httpx2.HTTPError, EOFError) as exc:
                self._lost.set()
                if not sending.written:
                    _not_sent(sending)
                    continue
                raise MCPConnectionLost(
                    f"lost its MCP server {self.server.name!r} mid-call ({type(exc).__name__})"
                ) from exc
            finally:
                outgoing.reset(token)
        raise MCPServerUnavailable(
            f"MCP server {self.server.name!r} is unavailable (it went away {_SEND_TRIES} "
            "times before the call could be sent)"
        )

    async def call(
        self,
        name: str,
        arguments: dict[str, Any],
        gate: SendGate | None = None,
    ) -> CallToolResult:
        """Call ``name`` on the server from any loop (cancelling this cancels the call).
        ``gate`` is asked right before the request is written (the caller may have given up),
        and told when a write failed.

        Raises:
            MCPServerUnavailable: it was not sent: the server is down and could not be
                brought back.
            MCPConnectionLost: it was sent, and the server went away before answering.
        """
        return await on_bridge(self._call_here(name, arguments, gate))

    def call_sync(self, name: str, arguments: dict[str, Any]) -> CallToolResult:
        """Call ``name`` and wait, from any thread but the bridge loop's."""
        return run_sync(self._call_here(name, arguments, None), in_running_loop=True)


@contextlib.asynccontextmanager
async def _marking(transport: Any) -> AsyncIterator[tuple[Any, Any]]:
    """``transport`` with its write stream marking a call's request written once handed to it
    (an HTTP transport sends it from a task of its own: handed over counts as sent)."""
    async with transport as (read_stream, write_stream):
        yield read_stream, _MarkingWriter(write_stream)


class _MarkingWriter:
    def __init__(self, inner: Any) -> None:
        self._inner = inner

    async def send(self, item: Any, /) -> None:
        call = outgoing.get() if getattr(item.message, "method", None) else None
        if call is not None and getattr(item.message, "id", None) is not None:
            if not call.may_send():
                raise NotSent("the call was given up before it was sent")
            call.written = True
        await self._inner.send(item)

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def __aenter__(self) -> _MarkingWriter:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class _ConnectingTransport(httpx2.AsyncBaseTransport):
    """The HTTP client's transport, telling a call whose POST could not even connect (the
    server is down) that its request never left. The SDK posts a request in a task run in
    the sender's context, so the call's [`Outgoing`][] is there."""

    def __init__(self, inner: httpx2.AsyncBaseTransport) -> None:
        self._inner = inner

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        try:
            return await self._inner.handle_async_request(request)
        except httpx2.ConnectError:
            call = outgoing.get()
            if call is not None and request.method == "POST":
                call.written = False  # no connection: not one byte of it was sent
            raise

    async def aclose(self) -> None:
        await self._inner.aclose()


def _not_sent(sending: Outgoing) -> None:
    if sending.gate is not None:
        sending.gate.not_sent()


def _root(exc: BaseException) -> BaseException:
    """The one error inside nested single-error groups (an anyio task group's)."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def _start_failure(server: ServerSettings, exc: Exception) -> Exception:
    """What ``start`` raises when the first connection fails: a configuration error as it is,
    anything else as a ToolDefinitionError naming the server (and the cause's type only)."""
    cause = _root(exc)
    if isinstance(cause, KeelError):
        return cause
    # A stdio failure names the command; an HTTP one only its type (a URL may hold secrets).
    detail = (
        f"{type(cause).__name__}: {cause}" if server.transport == "stdio" else type(cause).__name__
    )
    failure = ToolDefinitionError(
        f"MCP server {server.name!r} could not be started or listed ({detail})"
    )
    failure.__cause__ = cause
    return failure


def _session_unknown(error: MCPError) -> bool:
    """The streamable-HTTP server does not know the session (it restarted): the request was
    refused at the door, so nothing ran."""
    message = str(error.message if hasattr(error, "message") else error).lower()
    return "session not found" in message or "session terminated" in message


def _resolved(value: Any) -> str:
    return value if isinstance(value, str) else str(value.resolve())
