"""keel memory as an MCP server (the official ``mcp`` SDK): any MCP client can remember, search,
read, forget, and follow a fact over time, scoped per tenant and user, PII masked on write.

Over stdio the server acts for one tenant, fixed when it starts (``keel mcp --tenant T``: the
process is the user's own). Over streamable HTTP every request must carry
``Authorization: Bearer <key>`` from ``keel keys create --tenant T``: the key is checked before
the MCP session starts (401 otherwise) and names the tenant of every call it makes, so one
server serves many tenants and none sees another's records. The user is each tool's ``user``
argument, within that tenant.

A call that fails as expected (a record that is not the user's, an argument out of range, an
empty user) answers with its reason as the SDK's ``ToolError``, logged as one line; only a real
crash is answered with the SDK's generic message and logged with its traceback.

    from keel.integrations.mcp_server import memory_server
    server = memory_server(memory, tenant="acme")
    server.run("stdio")
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Literal, ParamSpec, TypeVar

try:
    from mcp.server.mcpserver import Context, MCPServer
    from mcp.server.mcpserver.exceptions import ToolError
except ImportError as exc:  # pragma: no cover - the extra is installed in tests
    from keel.errors import BackendUnavailableError

    raise BackendUnavailableError("the MCP SDK is not installed (the 'mcp' extra)") from exc

from keel._bridge import run_blocking
from keel.errors import UsageError
from keel.memory import Memory, MemoryRecord, Scope

__all__ = ["memory_server", "require_api_key"]

TenantOfKey = Callable[[str], str | None]
"""An API key's tenant, or None for an unknown or revoked key."""

_Params = ParamSpec("_Params")
_Result = TypeVar("_Result")
_Scope = MutableMapping[str, Any]
_ASGI = Callable[[_Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Any]


def _bearer(headers: Any) -> str | None:
    if not headers:
        return None
    scheme, _, key = str(headers.get("authorization", "")).partition(" ")
    return key.strip() if scheme.lower() == "bearer" and key.strip() else None


def _record(record: MemoryRecord) -> dict[str, Any]:
    """What a client sees of a record (never its embedding)."""
    return {
        "id": record.id,
        "kind": record.kind,
        "type": record.type,
        "text": record.text,
        "provenance": record.provenance,
        "created_at": record.created_at.isoformat(),
        "valid_from": None if record.valid_from is None else record.valid_from.isoformat(),
        "valid_to": None if record.valid_to is None else record.valid_to.isoformat(),
        "subject": record.subject,
        "attribute": record.attribute,
    }


def _with_reasons(
    tool: Callable[_Params, Awaitable[_Result]],
) -> Callable[_Params, Awaitable[_Result]]:
    """``tool`` with keel's expected failures (a ``UsageError``: a missing record, another
    user's, a bad argument) raised as the SDK's ``ToolError``: the client reads the reason
    and the server logs one line. Anything else stays a crash (a generic message, a logged
    traceback)."""

    @functools.wraps(tool)
    async def reasoned(*args: _Params.args, **kwargs: _Params.kwargs) -> _Result:
        try:
            return await tool(*args, **kwargs)
        except UsageError as exc:
            raise ToolError(str(exc)) from exc

    return reasoned


def memory_server(
    memory: Memory,
    *,
    tenant: str | None = None,
    tenant_of_key: TenantOfKey | None = None,
    name: str = "keel-memory",
) -> MCPServer:
    """An MCP server over ``memory``.

    Args:
        memory: where records live (masked on write by its masker, through the user's vault
            when the memory has one).
        tenant: the tenant of every call (stdio: the process acts for one tenant).
        tenant_of_key: for HTTP, the tenant of a request's bearer key; a call without a valid
            key is refused. Exactly one of ``tenant`` and ``tenant_of_key`` is given.
        name: the server's name for clients.
    """
    if (tenant is None) == (tenant_of_key is None):
        raise UsageError("give exactly one of tenant (stdio) and tenant_of_key (HTTP)")
    server = MCPServer(
        name,
        instructions="Long-term memory of one user: remember what matters, search before you "
        "answer, follow how a fact changed. Every call names the user.",
    )
    scope_of = _scope_resolver(tenant, tenant_of_key)
    _add_finding_tools(server, memory, scope_of)
    _add_record_tools(server, memory, scope_of)
    return server


_ScopeOf = Callable[[str, Context], Scope]


def _scope_resolver(tenant: str | None, tenant_of_key: TenantOfKey | None) -> _ScopeOf:
    """How a call's user (its argument) and tenant (fixed, or its bearer key's) become the
    scope it acts in."""

    def scope_of(user: str, ctx: Context) -> Scope:
        if not user.strip():
            raise UsageError("user must not be empty")
        if tenant is not None:
            return Scope(tenant_id=tenant, user_id=user)
        assert tenant_of_key is not None
        key = _bearer(ctx.headers)
        found = tenant_of_key(key) if key else None
        if found is None:
            raise UsageError("send Authorization: Bearer <API key> (keel keys create --tenant T)")
        return Scope(tenant_id=found, user_id=user)

    return scope_of


def _add_finding_tools(server: MCPServer, memory: Memory, scope_of: _ScopeOf) -> None:
    """The tools that add memories and find them: remember, remember_fact, search."""

    @server.tool()
    @_with_reasons
    async def remember(
        user: str,
        text: str,
        ctx: Context,
        kind: Literal["episodic", "semantic", "procedural"] = "semantic",
    ) -> dict[str, Any]:
        """Remember a note about the user (stored as the user's claim, PII masked).

        Args:
            user: The user the note is about.
            text: What to remember.
            kind: episodic (something that happened), semantic (a fact or preference) or
                procedural (how to do something).
        """
        record = await memory.aadd(text, scope=scope_of(user, ctx), kind=kind)
        return _record(record)

    @server.tool()
    @_with_reasons
    async def remember_fact(
        user: str, subject: str, attribute: str, value: str, ctx: Context
    ) -> dict[str, Any]:
        """Set a fact (subject's attribute = value); an earlier value becomes its history.

        Args:
            user: The user the fact belongs to.
            subject: Who or what the fact is about, e.g. "user".
            attribute: Which property, e.g. "home city".
            value: The new value.
        """
        scope = scope_of(user, ctx)
        record = await run_blocking(memory.remember_fact, scope, subject, attribute, value)
        return _record(record)

    @server.tool()
    @_with_reasons
    async def search(user: str, query: str, ctx: Context, k: int = 5) -> list[dict[str, Any]]:
        """The user's memories most relevant to the query, each with why it ranked.

        Args:
            user: Whose memories.
            query: What to look for.
            k: How many hits (1-50).
        """
        if not 1 <= k <= 50:
            raise UsageError(f"k must be between 1 and 50, got {k}")
        hits = await memory.asearch(query, scope=scope_of(user, ctx), k=k)
        return [
            {
                **_record(hit.record),
                "score": hit.score,
                "keyword_rank": hit.keyword_rank,
                "vector_rank": hit.vector_rank,
                "recency_boost": hit.recency_boost,
            }
            for hit in hits
        ]


def _add_record_tools(server: MCPServer, memory: Memory, scope_of: _ScopeOf) -> None:
    """The tools that act on one known record or fact: get, forget, fact_history."""

    @server.tool()
    @_with_reasons
    async def get(user: str, record_id: str, ctx: Context) -> dict[str, Any]:
        """One of the user's records by id.

        Args:
            user: Whose record.
            record_id: The record's id (from search or remember).
        """
        scope = scope_of(user, ctx)
        record = await run_blocking(memory.get, scope, record_id)
        if record is None:
            raise UsageError(f"the user has no record {record_id!r}")
        return _record(record)

    @server.tool()
    @_with_reasons
    async def forget(user: str, record_id: str, ctx: Context) -> dict[str, Any]:
        """Forget one of the user's records.

        Args:
            user: Whose record.
            record_id: The record's id.
        """
        scope = scope_of(user, ctx)
        forgotten = await run_blocking(memory.forget, scope, record_id)
        if not forgotten:
            raise UsageError(f"the user has no record {record_id!r}")
        return {"forgotten": record_id}

    @server.tool()
    @_with_reasons
    async def fact_history(
        user: str, subject: str, attribute: str, ctx: Context
    ) -> list[dict[str, Any]]:
        """Every value a fact has had, oldest first (superseded ones carry valid_to).

        Args:
            user: Whose fact.
            subject: Who or what it is about.
            attribute: Which property.
        """
        scope = scope_of(user, ctx)
        chain = await run_blocking(memory.fact_history, scope, subject, attribute)
        return [_record(record) for record in chain]


def require_api_key(app: _ASGI, tenant_of_key: TenantOfKey) -> _ASGI:
    """``app`` (the server's streamable HTTP app) behind the service's API keys: a request
    without a valid ``Authorization: Bearer`` key is answered 401 before MCP sees it."""

    async def guarded(scope: _Scope, receive: Any, send: Any) -> Any:
        if scope["type"] != "http":
            return await app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        key = _bearer(headers)
        if key is not None and tenant_of_key(key) is not None:
            return await app(scope, receive, send)
        body = b'{"error": {"type": "Unauthorized", "message": "send Authorization: Bearer <key>"}}'
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": body})
        return None

    return guarded
