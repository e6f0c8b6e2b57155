"""One worker of ``keel bench serve``: ``python -m keel.bench._serve_worker``.

It serves the real service (``build_service``) on the database (and Redis) named in
``KEEL_BENCH_WORKER`` (JSON), with a scripted model of fixed latency and one side-effecting
tool, ``book``, whose effect is a row in ``bench_effects`` (in PostgreSQL, or in a SQLite file
next to the database): the benchmark counts double effects from those rows, not from keel's
journal. The model calls ``book`` with the user's message (the turn's tag), then answers.
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.types import Message as ASGIMessage

from keel.messages import Message
from keel.service import Drain, DrainingServer, build_service
from keel.service._protocol import ServiceConfig
from keel.testing import ScriptedCall, ScriptedModel
from keel.tools import MCPServer, Tool, tool

__all__ = ["EFFECTS_TABLE", "WORKER_ENV", "effect_tool", "main"]

WORKER_ENV = "KEEL_BENCH_WORKER"
EFFECTS_TABLE = "bench_effects"


def _policy(call: ScriptedCall) -> Message | str:
    last = call.messages[-1]
    if last.role == "tool":
        return f"Done: {last.content}"
    return ScriptedModel.tool_call("book", json.dumps({"tag": call.last_user_text}))


def _mcp_policy(call: ScriptedCall) -> Message | str:
    """The MCP fault server's ``write`` instead of ``book``: its effect is a line in the
    server's own file."""
    last = call.messages[-1]
    if last.role == "tool":
        return f"Done: {last.content}"
    return ScriptedModel.tool_call("write", json.dumps({"item": call.last_user_text}))


async def _nothing_to_open() -> None:
    return None


def effect_tool(effects: str) -> tuple[Tool, Callable[[], Awaitable[None]]]:
    """``book(tag)``: one row per call in the effects table at ``effects`` (a PostgreSQL URL or
    a SQLite file path). The table has no unique key, so a second run of a call shows.

    With it, the coroutine function that opens the tool's own connection, for the worker's
    start-up: opened by the first call instead, it would add a new server connection's cost
    to the worker's first turn, counted as keel's time."""
    pid = os.getpid()
    if effects.startswith(("postgresql://", "postgres://")):
        import psycopg

        connection: list[psycopg.AsyncConnection[Any]] = []

        async def connect() -> None:
            # Again after the server went away (a restart closes it): the chaos bench stops
            # the database under the tool.
            if connection and connection[0].closed:
                connection.clear()
            if not connection:
                connection.append(await psycopg.AsyncConnection.connect(effects, autocommit=True))

        @tool(side_effect=True, idempotent=False)
        async def book(tag: str) -> str:
            """Book the trip named by the tag.

            Args:
                tag: The booking's reference.
            """
            await connect()
            await connection[0].execute(
                f"INSERT INTO {EFFECTS_TABLE} (tag, pid) VALUES (%s, %s)", (tag, pid)
            )
            return f"booked {tag}"

        return book, connect

    database = sqlite3.connect(effects, check_same_thread=False, isolation_level=None)
    database.execute("PRAGMA journal_mode=WAL")

    @tool(name="book", side_effect=True, idempotent=False)
    def book_in_sqlite(tag: str) -> str:
        """Book the trip named by the tag.

        Args:
            tag: The booking's reference.
        """
        database.execute(f"INSERT INTO {EFFECTS_TABLE} (tag, pid) VALUES (?, ?)", (tag, pid))
        return f"booked {tag}"

    return book_in_sqlite, _nothing_to_open


def _opening_first(app: ASGIApp, open_first: Callable[[], Awaitable[None]]) -> ASGIApp:
    """``app``, with ``open_first`` awaited when the server starts, before the app's own
    start-up (and so before it listens and answers ``/ready``)."""

    async def opening(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            return await app(scope, receive, send)

        async def receive_after_opening() -> ASGIMessage:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await open_first()
            return message

        return await app(scope, receive_after_opening, send)

    return opening


def main() -> None:
    options = json.loads(os.environ[WORKER_ENV])
    mcp_url = options.get("mcp_url")
    model = ScriptedModel(_mcp_policy if mcp_url else _policy, delay_s=options["model_latency_s"])
    drain = Drain()
    book, open_book = effect_tool(options["effects"])
    tools: list[Tool | MCPServer] = [book]
    if mcp_url:
        # The chaos bench's MCP server (keel's fault server over streamable HTTP), killed,
        # hung and stopped under load; its calls time out after a few seconds.
        tools.append(MCPServer.http(mcp_url, name="fault", timeout_s=options.get("mcp_timeout_s")))
    service, _, _ = build_service(
        options["database"],
        model=model,
        tools=tools,
        redis_url=options.get("redis_url") or "",
        memory=bool(options.get("memory", False)),
        drain=drain,
        lease_ttl_s=options["lease_ttl_s"],
        body_timeout_s=options.get("body_timeout_s", 30.0),
    )
    # The transport `keel serve` runs with: header and body deadlines, keel's access lines.
    config = ServiceConfig(
        _opening_first(service, open_book),
        host="127.0.0.1",
        port=options["port"],
        header_timeout_s=options.get("header_timeout_s", 10.0),
        body_timeout_s=options.get("body_timeout_s", 30.0),
    )
    DrainingServer(config, drain).run()


if __name__ == "__main__":
    main()
