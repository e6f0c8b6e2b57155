"""``keel mcp``: keel memory as an MCP server, over stdio or streamable HTTP."""

from __future__ import annotations

from typing import Annotated, Literal

import typer

from keel.cli._app import JsonOption, app, bench_app, emit_json, err_console, out_console
from keel.cli._database import CreateOption, DatabaseOption


@app.command("mcp")
def mcp_command(
    transport: Annotated[
        str, typer.Option(help="stdio (one tenant, for a local client) or http.")
    ] = "stdio",
    tenant: Annotated[str, typer.Option(help="stdio: the tenant every call acts for.")] = "default",
    host: Annotated[str, typer.Option(help="http: address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="http: port to listen on.")] = 8766,
    database: DatabaseOption = None,
    create: CreateOption = False,
) -> None:
    """Serve keel memory to MCP clients: remember, remember_fact, search, get, forget,
    fact_history, each for a user. Over http every request needs Authorization: Bearer <key>
    from `keel keys create --tenant T`, and acts for that key's tenant."""
    from keel.cli._database import database_settings
    from keel.errors import UsageError
    from keel.integrations.mcp_server import memory_server, require_api_key
    from keel.service import APIKeys, CachedKeys
    from keel.stores import Backends

    mode: Literal["stdio", "http"]
    if transport not in ("stdio", "http"):
        raise UsageError(f"--transport is stdio or http, not {transport!r}")
    mode = "stdio" if transport == "stdio" else "http"
    settings = database_settings(database, writes=True, create=create)
    # Memory masks with the default privacy policy, through the user's vault when the stores
    # open one (KEEL_PII_KEY); state stays off Redis (not used here).
    backends = Backends.open(settings, memory=True, redis_url="")
    try:
        memory = backends.memory
        if memory is None:
            raise UsageError("this database has no long-term memory")
        memory.start()
        # An MCP client starts this with its own, reduced environment (the SDK passes HOME
        # and PATH, not KEEL_*): say which database it serves, on stderr (stdout is the protocol).
        where = settings.parsed_database.redacted
        if mode == "stdio":
            err_console.print(f"keel mcp: stdio, tenant {tenant}, database {where}", markup=False)
            memory_server(memory, tenant=tenant).run("stdio")
            return
        import uvicorn

        # The MCP tools name any user of the tenant: only the tenant's operator keys serve.
        keys = CachedKeys(APIKeys(backends.sql).caller_of).operator_tenant
        server = memory_server(memory, tenant_of_key=keys)
        gated = require_api_key(server.streamable_http_app(host=host), keys)
        err_console.print(
            f"keel mcp: http://{host}:{port}/mcp (Bearer API keys), database {where}", markup=False
        )
        uvicorn.run(gated, host=host, port=port, log_level="warning")
    finally:
        backends.close()


@bench_app.command("mcp")
def bench_mcp_command(
    calls: Annotated[int, typer.Option("--calls", min=1, help="Tool calls each way.")] = 500,
    kills: Annotated[int, typer.Option("--kills", min=0, help="Workers SIGKILLed.")] = 5,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the kill points.")] = 7,
    as_json: JsonOption = False,
) -> None:
    """keel's added time per MCP tool call over the raw SDK client, and exactly-once under
    SIGKILL counted from the server's own effects."""
    # The bench starts MCP servers: the optional SDK is loaded only when it runs.
    from keel.bench.mcp import run_mcp_bench

    report = run_mcp_bench(calls, kills=kills, seed=seed)
    if as_json:
        emit_json(report.model_dump())
        return
    for name, value in report.model_dump().items():
        out_console.print(f"{name:<24} {value}")
