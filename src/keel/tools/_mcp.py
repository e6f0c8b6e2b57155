"""MCP servers as a source of tools, next to Python ones: ``MCPServer.stdio(...)`` and
``MCPServer.http(...)`` describe a server; an agent given one (``Agent(tools=[..., server])``)
connects on its first turn, lists its tools, and lists them again when the server says they
changed; ``Agent.aclose`` disconnects (``AgentServers``).

Each MCP tool becomes a [`SchemaTool`][]: its JSON schema validates the model's
arguments, and its annotations set keel's flags. ``readOnlyHint`` means no side effect; any
other tool is side-effecting, idempotent only with ``idempotentHint`` (an unannotated tool is
side-effecting and not idempotent, the safe default). A deployment overrides any of it per tool
([`MCPToolOverride`][]): flags, hidden from the model, arguments injected on every call.

Names: a tool keeps its server's name (``prefix=`` prepends one); a name two servers (or a
Python tool) share is a [`ToolDefinitionError`][] when they connect, and a tool that
appears later under a taken name is left out (logged). Secrets in headers and environment
come from the environment ([`FromEnv`][]), are read when the server is connected, and
never appear in a ``repr``, a log line or a trace.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from keel._bridge import on_bridge, run_sync
from keel.errors import ConfigError, ToolDefinitionError, ToolExecutionError, ToolInDoubtError
from keel.tools._executor import call_dispatch
from keel.tools._schema_tool import SchemaTool, schema_tool
from keel.tools._tool import _NAME, ApprovalPolicy, ToolContext

if TYPE_CHECKING:
    # The connection imports the optional ``mcp`` SDK; only started servers load it.
    from keel.tools._mcp_connection import Connection

__all__ = [
    "AgentServers",
    "FromEnv",
    "MCPServer",
    "MCPToolError",
    "MCPToolOverride",
    "check_names",
    "start_servers",
]

logger = logging.getLogger("keel.tools.mcp")

_MASK = "***"


@dataclass(frozen=True)
class FromEnv:
    """A header or environment value read from this process's environment when the server
    is connected (``FromEnv("GIT_TOKEN", template="Bearer {}")``): the secret is in no
    configuration file, ``repr`` or log line."""

    variable: str
    template: str = "{}"

    def resolve(self) -> str:
        """The value, formatted into the template.

        Raises:
            ConfigError: the variable is not set.
        """
        value = os.environ.get(self.variable)
        if value is None:
            raise ConfigError(f"environment variable {self.variable} is not set")
        return self.template.format(value)


SettingValue = str | FromEnv
"""A header or environment value: as given, or read from the environment at connect time."""


@dataclass(frozen=True)
class MCPToolOverride:
    """What a deployment says about one MCP tool, over what its annotations say.

    Args:
        side_effect: the tool changes the world (None: from ``readOnlyHint``).
        idempotent: running it twice is the same as once (None: from ``idempotentHint``).
        hidden: left out of the model's tools (the deployment can still call it).
        inject: arguments added to every call, removed from the schema the model sees (the
            model can neither see nor choose them: a tenant's ``state_key``, say).
        timeout_s / max_output_chars: as for [`tool`][].
        sees_values: with a PII vault, the server gets the user's real values for the
            placeholders in the arguments (False: it gets the placeholders; for a server the
            deployment does not trust with them).
        masked_arguments: arguments that keep their placeholders even so (secrets).
        approval: the call waits for a person before it runs, as ``@tool(approval=...)``.
        waiting_message: what the customer reads meanwhile, as ``@tool(waiting_message=...)``.
    """

    side_effect: bool | None = None
    idempotent: bool | None = None
    hidden: bool = False
    inject: Mapping[str, Any] = field(default_factory=dict)
    timeout_s: float | None = None
    max_output_chars: int | None = None
    sees_values: bool = True
    masked_arguments: tuple[str, ...] = ()
    approval: ApprovalPolicy | None = None
    waiting_message: str | None = None


class MCPToolError(Exception):
    """An MCP tool answered with ``isError``: the call ran and failed (not in doubt)."""


@dataclass(frozen=True, repr=False, eq=False)
class MCPServer:
    """An MCP server whose tools an agent may call. Build one with [`stdio`][] or
    [`http`][]; give it to an agent in ``tools=``.

    An agent given a server that is not started starts it on its first turn (or as ``async
    with agent:`` begins) and closes it in ``Agent.aclose`` (several agents may share one: the
    last to close it stops it). A server you started yourself ([`start`][], ``with server:``)
    stays yours: agents use it as it is and never close it. A stdio server that exits is
    started again, an HTTP one reconnected, with backoff (0.1 s doubling to 5 s; a call that
    needs it now cuts the wait short). A call that never reached the server (it was down and
    could not be brought back) fails as a [`ToolNotRunError`][keel.errors.ToolNotRunError],
    never in doubt. Every server's session lives on keel's bridge loop (the MCP SDK ties a
    session to one loop).
    """

    name: str
    transport: Literal["stdio", "http"]
    command: str | None = None
    args: tuple[str, ...] = ()
    env: Mapping[str, SettingValue] = field(default_factory=dict)
    cwd: str | None = None
    url: str | None = None
    headers: Mapping[str, SettingValue] = field(default_factory=dict)
    overrides: Mapping[str, MCPToolOverride] = field(default_factory=dict)
    prefix: str = ""
    timeout_s: float | None = None
    connect_timeout_s: float = 30.0
    _state: dict[str, Any] = field(default_factory=dict, init=False, compare=False)

    @classmethod
    def stdio(
        cls,
        command: str,
        args: Sequence[str] = (),
        *,
        env: Mapping[str, SettingValue] | None = None,
        cwd: str | None = None,
        name: str | None = None,
        tools: Mapping[str, MCPToolOverride] | None = None,
        prefix: str = "",
        timeout_s: float | None = None,
        connect_timeout_s: float = 30.0,
    ) -> MCPServer:
        """A server this process starts as ``command args...`` and talks to over stdio.

        ``env`` is added to a minimal inherited environment (``PATH``, ``HOME``...), not to
        all of this process's; ``tools`` overrides tools by their server-side name;
        ``timeout_s`` is each call's default limit (else the agent's).
        """
        return cls(
            name=name or Path(command).name,
            transport="stdio",
            command=command,
            args=tuple(args),
            env=dict(env or {}),
            cwd=cwd,
            overrides=dict(tools or {}),
            prefix=prefix,
            timeout_s=timeout_s,
            connect_timeout_s=connect_timeout_s,
        )

    @classmethod
    def http(
        cls,
        url: str,
        *,
        headers: Mapping[str, SettingValue] | None = None,
        name: str | None = None,
        tools: Mapping[str, MCPToolOverride] | None = None,
        prefix: str = "",
        timeout_s: float | None = None,
        connect_timeout_s: float = 30.0,
    ) -> MCPServer:
        """A server reached over streamable HTTP at ``url``, sending ``headers``."""
        return cls(
            name=name or url,
            transport="http",
            url=url,
            headers=dict(headers or {}),
            overrides=dict(tools or {}),
            prefix=prefix,
            timeout_s=timeout_s,
            connect_timeout_s=connect_timeout_s,
        )

    def with_settings(
        self,
        *,
        headers: Mapping[str, SettingValue] | None = None,
        env: Mapping[str, SettingValue] | None = None,
    ) -> MCPServer:
        """A copy (not started) with these headers / environment values added: one per
        tenant, each tenant's agent with its own credentials."""
        return dataclasses.replace(
            self,
            headers={**self.headers, **(headers or {})},
            env={**self.env, **(env or {})},
        )

    def __repr__(self) -> str:
        where = self.url if self.transport == "http" else " ".join([self.command or "", *self.args])
        masked = dict.fromkeys({**self.env, **self.headers}, _MASK)
        return f"MCPServer({self.name!r}, {self.transport}: {where!r}, settings={masked})"

    # --- the connection ----------------------------------------------------------------------

    def start(self) -> None:
        """Connect and list the tools (once; later calls return at once); yours to
        [`close`][]. A server that fails before listing its tools (it exits, refuses the
        connection) is left out at once, one that has not listed them within
        ``connect_timeout_s`` (hung) then: logged with the reason (a stdio server's exit code
        and last stderr lines, masked), it offers no tools until its listing arrives (it is
        retried with backoff), and never holds up the agent or a turn. Callable inside a
        running event loop (which waits), as ``with server:`` is; [`astart`][] is its async
        twin.

        Raises:
            ConfigError: the ``mcp`` extra is not installed, or a [`FromEnv`][] is unset.
            ToolDefinitionError: the server is misconfigured: its command cannot be run.
        """
        run_sync(self.astart(), in_running_loop=True)

    async def astart(self) -> None:
        """Async twin of [`start`][]."""
        await on_bridge(self._start_here(by_agent=False))

    def close(self) -> None:
        """Disconnect (a stdio server is stopped); a later [`start`][] connects again."""
        run_sync(self.aclose(), in_running_loop=True)

    async def aclose(self) -> None:
        """Async twin of [`close`][]."""
        await on_bridge(self._close_here())

    def __enter__(self) -> MCPServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def __aenter__(self) -> MCPServer:
        await self.astart()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # On the bridge loop: the one thread that changes ``_state`` once a server is in use.

    async def _start_here(self, *, by_agent: bool) -> None:
        starting: asyncio.Future[None] | None = self._state.get("starting")
        if starting is None and "connection" not in self._state:
            starting = self._state["starting"] = asyncio.ensure_future(self._connect())
        if starting is not None:  # one connection, whoever else waits for it
            try:
                await asyncio.shield(starting)
            finally:
                if starting.done():
                    self._state.pop("starting", None)
        if not by_agent:
            self._state["owned"] = True  # started by its owner: agents never close it

    async def _connect(self) -> None:
        try:
            # The optional SDK, loaded only when a server is used.
            from keel.tools._mcp_connection import Connection
        except ImportError as exc:  # pragma: no cover - the extra is part of the test set-up
            raise ConfigError(
                "MCP servers need the mcp extra: pip install 'keel-runtime[mcp]'"
            ) from exc
        connection = Connection(self, partial(build_tools, self))
        await connection.astart(self.connect_timeout_s)
        self._state["connection"] = connection

    async def _close_here(self) -> None:
        connection: Connection | None = self._state.pop("connection", None)
        self._state.pop("owned", None)
        self._state.pop("agents", None)
        if connection is not None:
            await connection.aclose()

    @property
    def _started_by_owner(self) -> bool:
        return bool(self._state.get("owned"))

    async def _hold(self) -> None:
        """An agent starts using the server: started unless it is (by another agent)."""
        if self._started_by_owner:
            return
        await self._start_here(by_agent=True)
        self._state["agents"] = self._state.get("agents", 0) + 1

    async def _let_go(self) -> None:
        """An agent that used the server closes: the last agent to let go stops it."""
        if self._started_by_owner:
            return
        agents = self._state.get("agents", 0)
        if agents <= 1:
            await self._close_here()
        else:
            self._state["agents"] = agents - 1

    @property
    def _connection(self) -> Connection:
        connection: Connection | None = self._state.get("connection")
        if connection is None:
            raise ToolExecutionError(f"MCP server {self.name!r} is not started")
        return connection

    def tools(self) -> dict[str, SchemaTool]:
        """The tools the model may call now, by keel name (hidden ones left out); none while
        the server is closed (a turn then offers none of them, and never fails for it)."""
        connection: Connection | None = self._state.get("connection")
        return {} if connection is None else dict(connection.tools)

    @property
    def problems(self) -> list[str]:
        """Why listed tools were left out (a malformed schema, an unusable name...)."""
        return list(self._connection.problems)

    async def acall(self, name: str, arguments: Mapping[str, Any] | None = None) -> str:
        """Call a tool by its server-side name, hidden ones too (the deployment's own calls:
        a reset, a log): its text, or [`MCPToolError`][]. Not journalled."""
        result = await self._connection.call(name, dict(arguments or {}))
        return result_text(result, name)

    def call(self, name: str, arguments: Mapping[str, Any] | None = None) -> str:
        """Sync twin of [`acall`][]."""
        return result_text(self._connection.call_sync(name, dict(arguments or {})), name)


def build_tools(
    server: MCPServer, listed: Sequence[Any], connection: Connection
) -> tuple[dict[str, SchemaTool], list[str]]:
    """The listed MCP tools as keel tools (by keel name), and why any were left out."""
    tools: dict[str, SchemaTool] = {}
    problems: list[str] = []
    for mcp_tool in listed:
        override = server.overrides.get(mcp_tool.name, MCPToolOverride())
        if override.hidden:
            continue
        try:
            built = _schema_tool(server, mcp_tool, override, connection)
        except ToolDefinitionError as exc:
            problems.append(str(exc))
            logger.warning("MCP server %r: tool left out: %s", server.name, exc)
            continue
        tools[built.name] = built
    return tools, problems


def _keel_name(server: MCPServer, name: str) -> str:
    keel_name = server.prefix + re.sub(r"[^a-zA-Z0-9_-]", "_", name)
    if not _NAME.match(keel_name):
        raise ToolDefinitionError(f"MCP tool {name!r} has no usable name ({keel_name!r})")
    return keel_name


def _schema_tool(
    server: MCPServer, mcp_tool: Any, override: MCPToolOverride, connection: Connection
) -> SchemaTool:
    annotations = mcp_tool.annotations
    read_only = bool(annotations is not None and annotations.read_only_hint)
    declared_idempotent = bool(annotations is not None and annotations.idempotent_hint)
    side_effect = not read_only if override.side_effect is None else override.side_effect
    idempotent = (
        (not side_effect or declared_idempotent)
        if override.idempotent is None
        else override.idempotent
    )
    schema = _without(dict(mcp_tool.input_schema or {}), override.inject)
    remote = mcp_tool.name
    injected = dict(override.inject)

    # Loaded by now: a listing comes from a connection.
    from keel.tools._mcp_connection import MCPConnectionLost

    async def call(arguments: dict[str, Any], context: ToolContext | None) -> str:
        sent = {**arguments, **injected}
        # The executor learns whether the request was written: one still unsent at its
        # timeout never ran. A server that is down and cannot be restarted raises
        # MCPServerUnavailable (a ToolNotRunError): a plain failure, not in doubt.
        dispatch = call_dispatch.get()
        if dispatch is not None:
            dispatch.track()
        try:
            result = await connection.call(remote, sent, dispatch)
        except MCPConnectionLost as lost:
            if idempotent:
                # Harmless to repeat by its declaration: once more, on the new connection
                # (the wait for it is bounded by the call's timeout).
                return result_text(await connection.call(remote, sent), remote)
            key = context.idempotency_key if context is not None else "?"
            raise ToolInDoubtError(remote, key, why=str(lost)) from lost
        return result_text(result, remote)

    return schema_tool(
        _keel_name(server, remote),
        mcp_tool.description or mcp_tool.title or remote,
        schema,
        call,
        side_effect=side_effect,
        idempotent=idempotent,
        timeout_s=override.timeout_s if override.timeout_s is not None else server.timeout_s,
        max_output_chars=override.max_output_chars,
        sees_values=override.sees_values,
        masked_arguments=tuple(override.masked_arguments),
        approval=override.approval,
        waiting_message=override.waiting_message,
    )


def _without(schema: dict[str, Any], injected: Mapping[str, Any]) -> dict[str, Any]:
    """``schema`` without the injected arguments: the model neither sees nor sets them."""
    if not injected:
        return schema
    properties = schema.get("properties")
    if isinstance(properties, Mapping):
        schema["properties"] = {k: v for k, v in properties.items() if k not in injected}
    required = schema.get("required")
    if isinstance(required, list):
        schema["required"] = [name for name in required if name not in injected]
    return schema


def result_text(result: Any, tool_name: str) -> str:
    """An MCP ``CallToolResult`` as text for the model; ``isError`` raises MCPToolError."""
    parts: list[str] = []
    for item in result.content or []:
        kind = getattr(item, "type", "")
        if kind == "text":
            parts.append(item.text)
        elif kind == "resource" and hasattr(item.resource, "text"):
            parts.append(item.resource.text)
        elif kind in ("image", "audio"):
            parts.append(f"[{kind}: {item.mime_type}, {len(item.data)} base64 characters]")
        elif kind == "resource_link":
            parts.append(f"[resource: {item.uri}]")
        else:
            parts.append(f"[{kind or type(item).__name__} content]")
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False, default=str))
    text = "\n".join(parts)
    if result.is_error:
        raise MCPToolError(text or f"{tool_name} reported an error")
    return text


def start_servers(
    servers: Sequence[MCPServer], *, taken: set[str], strict: bool = False
) -> list[MCPServer]:
    """Start ``servers`` (each one's [`start`][keel.tools.MCPServer.start]) and check their
    tools' names against ``taken`` and each other's; on any failure the ones started here are
    closed again. ``keel serve`` starts its agent's servers so (``strict``), before it takes
    traffic.

    Args:
        servers: the servers.
        taken: the names of the Python tools beside them.
        strict: a stdio server that fails before it lists its tools (its process exits at
            once: a wrong argument, a missing module) fails this too, where
            [`start`][keel.tools.MCPServer.start] leaves it out and retries it. A server over
            HTTP that cannot be reached yet is left out either way, as a store that is down
            does not stop ``keel serve`` (``/ready`` reports it).

    Returns:
        The servers started here (one started already is left as it is): yours to close.

    Raises:
        ToolDefinitionError: a server's command cannot be run, or (``strict``) a stdio
            server failed before listing its tools: the error names the server (and its exit
            code and last stderr lines, masked); or two tools share a name.
        ConfigError: the ``mcp`` extra is not installed, or a [`FromEnv`][] is unset.
    """
    started: list[MCPServer] = []
    try:
        for server in servers:
            if "connection" not in server._state:
                server.start()
                started.append(server)
                if strict:
                    _require_listed(server)
        check_names(servers, taken=taken)
    except BaseException:
        # Every server started here is stopped, whichever of them fails to stop: the start's
        # own error is the one raised, and a process left running would outlive its caller.
        for server in started:
            try:
                server.close()
            except Exception:
                logger.warning("MCP server %r did not stop cleanly", server.name, exc_info=True)
        raise
    return started


def _require_listed(server: MCPServer) -> None:
    """Refuse a stdio server whose first connection failed (see `start_servers`).

    Raises:
        ToolDefinitionError: it did, naming it and saying why.
    """
    left_out = server._connection.left_out
    if server.transport == "stdio" and left_out is not None:
        raise ToolDefinitionError(
            f"MCP server {server.name!r} {left_out}: check its command, arguments and environment"
        )


def check_names(
    servers: Sequence[MCPServer], *, taken: set[str], reserved: Sequence[str] = ()
) -> None:
    """Check the tools ``servers`` list now against ``taken`` (Python tools'), ``reserved``
    (a workflow's) and each other's.

    Raises:
        ToolDefinitionError: two tools share a name.
    """
    owners = dict.fromkeys(taken, "a Python tool") | dict.fromkeys(reserved, "the workflow's")
    for server in servers:
        for name in server.tools():
            if name in owners:
                raise ToolDefinitionError(
                    f"tool {name!r} of MCP server {server.name!r} clashes with "
                    f"{owners[name]}; give the server a prefix "
                    f"(MCPServer.stdio(..., prefix='{server.name}_'))"
                )
            owners[name] = f"MCP server {server.name!r}'s"


class AgentServers:
    """An agent's MCP servers. Those not started by their owner are the agents': started on
    the agent's first turn ([`open`][]), let go when it closes ([`aclose`][]; the last agent
    sharing one stops it). Those their owner started are used as they are.

    Raises:
        ToolDefinitionError: (built) two tools listed now share a name.
    """

    def __init__(
        self, servers: Sequence[MCPServer], *, taken: set[str], reserved: Sequence[str] = ()
    ) -> None:
        self.servers = list(servers)
        self._taken, self._reserved = set(taken), tuple(reserved)
        self._held = [server for server in self.servers if not server._started_by_owner]
        self._open = not self._held
        self._lock: asyncio.Lock | None = None
        check_names(self.servers, taken=self._taken, reserved=self._reserved)

    def open_sync(self) -> None:
        """Sync twin of [`open`][] (at once, inside a running loop too, when it has)."""
        if not self._open:
            run_sync(self.open())

    async def open(self) -> None:
        """Start the servers the agent holds (once: at once when it has).

        Raises:
            ConfigError: the ``mcp`` extra is not installed, or a [`FromEnv`][] is unset.
            ToolDefinitionError: a server's command cannot be run, or two tools share a name;
                the servers held here are let go again.
        """
        if not self._open:
            await on_bridge(self._open_here())

    async def aclose(self) -> None:
        """Let go of the servers [`open`][] started (a later `open` starts them again)."""
        if self._held and self._open:
            await on_bridge(self._close_here())

    def _guard(self) -> asyncio.Lock:
        if self._lock is None:  # made on the bridge loop, where every open and close runs
            self._lock = asyncio.Lock()
        return self._lock

    async def _open_here(self) -> None:
        async with self._guard():
            if self._open:
                return
            held: list[MCPServer] = []
            try:
                for server in self._held:
                    await server._hold()
                    held.append(server)
                check_names(self.servers, taken=self._taken, reserved=self._reserved)
            except BaseException:
                for server in held:
                    await server._let_go()
                raise
            self._open = True

    async def _close_here(self) -> None:
        async with self._guard():
            if not self._open:
                return
            self._open = False
            for server in self._held:
                await server._let_go()
