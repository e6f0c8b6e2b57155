"""MCP servers as a source of tools, next to Python ones: ``MCPServer.stdio(...)`` and
``MCPServer.http(...)`` describe a server; an agent given one (``Agent(tools=[..., server])``)
connects at start-up, lists its tools, and lists them again when the server says they changed.

Each MCP tool becomes a [`SchemaTool`][]: its JSON schema validates the model's
arguments, and its annotations set keel's flags. ``readOnlyHint`` means no side effect; any
other tool is side-effecting, idempotent only with ``idempotentHint`` (an unannotated tool is
side-effecting and not idempotent, the safe default). A deployment overrides any of it per tool
([`MCPToolOverride`][]): flags, hidden from the model, arguments injected on every call.

Names: a tool keeps its server's name (``prefix=`` prepends one); a name two servers (or a
Python tool) share is a [`ToolDefinitionError`][] at start-up, and a tool that
appears later under a taken name is left out (logged). Secrets in headers and environment
come from the environment ([`FromEnv`][]), are read when the server is connected, and
never appear in a ``repr``, a log line or a trace.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from keel.errors import ConfigError, ToolDefinitionError, ToolExecutionError, ToolInDoubtError
from keel.tools._schema_tool import SchemaTool, schema_tool
from keel.tools._tool import _NAME, ApprovalPolicy, ToolContext

if TYPE_CHECKING:
    # The connection imports the optional ``mcp`` SDK; only started servers load it.
    from keel.tools._mcp_connection import Connection

__all__ = ["FromEnv", "MCPServer", "MCPToolError", "MCPToolOverride"]

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


class MCPConnectionLost(ConnectionError):
    """The server went away during a read-only call (it is being restarted)."""


@dataclass(frozen=True, repr=False, eq=False)
class MCPServer:
    """An MCP server whose tools an agent may call. Build one with [`stdio`][] or
    [`http`][]; give it to an agent in ``tools=``.

    The agent connects it ([`start`][]) when it is built; a stdio server that exits is
    started again, an HTTP one reconnected, with backoff (0.1 s doubling to 5 s). Close it with
    [`close`][] (or ``with server:``); several agents may share one server.
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
        """Connect and list the tools (once; later calls return at once). A server that has
        not listed its tools within ``connect_timeout_s`` (hung) is left out, logged: it offers
        no tools until its listing arrives, and never holds up the agent or a turn.

        Raises:
            ConfigError: the ``mcp`` extra is not installed, or a [`FromEnv`][] is unset.
            ToolDefinitionError: the server could not be started or reached (a failure).
        """
        if "connection" in self._state:
            return
        try:
            # The optional SDK, loaded only when a server is used.
            from keel.tools._mcp_connection import Connection
        except ImportError as exc:  # pragma: no cover - the extra is part of the test set-up
            raise ConfigError(
                "MCP servers need the mcp extra: pip install 'keel-runtime[mcp]'"
            ) from exc
        connection = Connection(self)
        connection.start(self.connect_timeout_s)
        self._state["connection"] = connection

    def close(self) -> None:
        """Disconnect (a stdio server is stopped); a later [`start`][] connects again."""
        connection: Connection | None = self._state.pop("connection", None)
        if connection is not None:
            connection.close()

    def __enter__(self) -> MCPServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

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
        return self._connection.call_sync(name, dict(arguments or {}))


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

    async def call(arguments: dict[str, Any], context: ToolContext | None) -> str:
        sent = {**arguments, **injected}
        try:
            result = await connection.call(remote, sent)
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


def start_servers(servers: Sequence[MCPServer], *, taken: set[str]) -> None:
    """Start ``servers`` (an agent's, when it is built) and check their tools' names against
    ``taken`` and each other's; on any failure the ones started here are closed again.

    Raises:
        ToolDefinitionError: a server could not start, or two tools share a name.
    """
    owners = dict.fromkeys(taken, "a Python tool")
    started: list[MCPServer] = []
    try:
        for server in servers:
            if "connection" not in server._state:
                server.start()
                started.append(server)
            for name in server.tools():
                if name in owners:
                    raise ToolDefinitionError(
                        f"tool {name!r} of MCP server {server.name!r} clashes with "
                        f"{owners[name]}; give the server a prefix "
                        f"(MCPServer.stdio(..., prefix='{server.name}_'))"
                    )
                owners[name] = f"MCP server {server.name!r}'s"
    except BaseException:
        for server in started:
            server.close()
        raise
