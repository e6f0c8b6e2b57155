"""``keel mcp`` with the official MCP SDK's client, over stdio and over streamable HTTP: the
memory tools work, PII is masked before it is stored, and a tenant's key sees only its own."""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import httpx2
import pytest
from mcp import Client, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client

from keel.testing.servers import free_port
from tests.service.conftest import create_key

EMAIL = "ada@example.com"


def _env(tmp_path: Path) -> dict[str, str]:
    return {
        **os.environ,
        "KEEL_DATA_DIR": str(tmp_path / "data"),
        "KEEL_EMBEDDER": "hashing:64",
        "KEEL_DATABASE": f"sqlite:///{tmp_path / 'keel.db'}",
    }


def _data(result: Any) -> Any:
    assert not result.is_error, result.content
    if result.structured_content is not None:
        content = result.structured_content
        return content.get("result", content) if isinstance(content, dict) else content
    return json.loads(result.content[0].text)


async def test_memory_over_stdio_masks_pii_and_follows_a_fact(tmp_path: Path) -> None:
    env = _env(tmp_path)
    server = StdioServerParameters(
        command=sys.executable, args=["-m", "keel", "mcp", "--tenant", "acme"], env=env
    )
    async with Client(server) as client:
        tools = {tool.name for tool in (await client.list_tools()).tools}
        assert tools == {"remember", "remember_fact", "search", "get", "forget", "fact_history"}
        note = _data(
            await client.call_tool(
                "remember", {"user": "u1", "text": f"Prefers window seats; mail {EMAIL}"}
            )
        )
        assert EMAIL not in note["text"] and note["provenance"] == "user_claim"
        hits = _data(await client.call_tool("search", {"user": "u1", "query": "window seats"}))
        assert [hit["id"] for hit in hits] == [note["id"]]
        assert hits[0]["keyword_rank"] == 1
        assert _data(await client.call_tool("search", {"user": "u2", "query": "window"})) == []
        for city in ("Oslo", "Lima"):
            _data(
                await client.call_tool(
                    "remember_fact",
                    {"user": "u1", "subject": "user", "attribute": "home city", "value": city},
                )
            )
        chain = _data(
            await client.call_tool(
                "fact_history", {"user": "u1", "subject": "user", "attribute": "home city"}
            )
        )
        assert [("Oslo" in r["text"], r["valid_to"] is not None) for r in chain] == [
            (True, True),
            (False, False),
        ]
        assert _data(await client.call_tool("get", {"user": "u1", "record_id": note["id"]}))
        assert (await client.call_tool("get", {"user": "u2", "record_id": note["id"]})).is_error
        forgotten = await client.call_tool("forget", {"user": "u1", "record_id": note["id"]})
        assert _data(forgotten) == {"forgotten": note["id"]}
        assert (await client.call_tool("get", {"user": "u1", "record_id": note["id"]})).is_error
    with sqlite3.connect(tmp_path / "keel.db") as conn:
        dumped = "\n".join(conn.iterdump())
    assert EMAIL not in dumped, "an e-mail address reached storage unmasked"


def _error_text(result: Any) -> str:
    assert result.is_error, result.content
    return " ".join(getattr(part, "text", "") for part in result.content)


async def test_an_expected_failure_reaches_the_client_with_its_reason(tmp_path: Path) -> None:
    """A missing record, another user's, ``k=0``, an empty user, empty text: the client reads
    why (the SDK's ``ToolError``), and the server logs no crash for any of them."""
    server = StdioServerParameters(
        command=sys.executable, args=["-m", "keel", "mcp", "--tenant", "acme"], env=_env(tmp_path)
    )
    stderr_path = tmp_path / "server-stderr.txt"
    with stderr_path.open("w") as stderr:
        async with Client(stdio_client(server, errlog=stderr)) as client:
            note = _data(await client.call_tool("remember", {"user": "u1", "text": "Likes tea"}))
            calls = {
                "get nope": ("get", {"user": "u1", "record_id": "nope"}),
                "get another user's": ("get", {"user": "u2", "record_id": note["id"]}),
                "forget another user's": ("forget", {"user": "u2", "record_id": note["id"]}),
                "k=0": ("search", {"user": "u1", "query": "tea", "k": 0}),
                "empty user": ("search", {"user": " ", "query": "tea"}),
                "empty text": ("remember", {"user": "u1", "text": "  "}),
            }
            reasons = {
                case: _error_text(await client.call_tool(tool, arguments))
                for case, (tool, arguments) in calls.items()
            }
    assert reasons == {
        "get nope": "Error executing tool get: the user has no record 'nope'",
        "get another user's": f"Error executing tool get: the user has no record {note['id']!r}",
        "forget another user's": (
            f"Error executing tool forget: the user has no record {note['id']!r}"
        ),
        "k=0": "Error executing tool search: k must be between 1 and 50, got 0",
        "empty user": "Error executing tool search: user must not be empty",
        "empty text": "Error executing tool remember: a memory needs non-empty text",
    }
    logged = stderr_path.read_text()
    assert "Traceback" not in logged and "unexpected exception" not in logged, logged


@pytest.fixture
def http_server(tmp_path: Path) -> Any:
    import subprocess
    import time

    env = _env(tmp_path)
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "keel", "mcp", "--transport", "http", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}/mcp"
    deadline = time.monotonic() + 60
    while True:
        assert process.poll() is None, process.communicate()[1]
        try:
            httpx.post(url, timeout=1)
            break
        except httpx.HTTPError:
            assert time.monotonic() < deadline, "keel mcp did not start"
            time.sleep(0.1)
    try:
        yield url, env
    finally:
        process.terminate()
        process.communicate(timeout=30)


@contextlib.asynccontextmanager
async def _as(url: str, key: str) -> AsyncIterator[Client]:
    """An MCP client over HTTP carrying ``key``; its HTTP client closed afterwards."""
    headers = {"Authorization": f"Bearer {key}"}
    async with (
        httpx2.AsyncClient(headers=headers, timeout=30) as http,
        Client(streamable_http_client(url, http_client=http)) as client,
    ):
        yield client


async def test_memory_over_http_needs_a_key_and_keeps_tenants_apart(http_server: Any) -> None:
    url, env = http_server
    assert httpx.post(url, json={}).status_code == 401
    forged = httpx.post(url, json={}, headers={"Authorization": "Bearer keel_0_forged"})
    assert forged.status_code == 401
    acme, globex = create_key("acme", env), create_key("globex", env)
    async with _as(url, acme) as client:
        note = _data(
            await client.call_tool("remember", {"user": "u1", "text": "Allergic to peanuts"})
        )
        hits = _data(await client.call_tool("search", {"user": "u1", "query": "peanuts"}))
        assert [hit["id"] for hit in hits] == [note["id"]]
    async with _as(url, globex) as other:
        assert _data(await other.call_tool("search", {"user": "u1", "query": "peanuts"})) == []
        missing = f"the user has no record {note['id']!r}"
        theirs = await other.call_tool("get", {"user": "u1", "record_id": note["id"]})
        assert _error_text(theirs).endswith(missing)
        forgotten = await other.call_tool("forget", {"user": "u1", "record_id": note["id"]})
        assert _error_text(forgotten).endswith(missing)
    async with _as(url, acme) as client:
        assert _data(await client.call_tool("get", {"user": "u1", "record_id": note["id"]}))


def test_memory_over_http_refuses_a_key_of_one_user(http_server: Any) -> None:
    import subprocess

    url, env = http_server
    created = subprocess.run(
        [sys.executable, "-m", "keel", "keys", "create", "--tenant", "acme", "--user", "u1"],
        capture_output=True, text=True, env=env, timeout=120, check=True,
    )  # fmt: skip
    user_key = created.stdout.strip().splitlines()[-1]
    refused = httpx.post(url, json={}, headers={"Authorization": f"Bearer {user_key}"})
    assert refused.status_code == 401, "a user's key reached every user's memory"
    operator = httpx.post(
        url, json={}, headers={"Authorization": f"Bearer {create_key('acme', env)}"}
    )
    assert operator.status_code != 401


def test_stdio_says_which_database_it_serves(tmp_path: Path) -> None:
    """An MCP client starts ``keel mcp`` with the SDK's reduced environment (HOME and PATH,
    not ``KEEL_*``): the server silently served the home directory's database, and said
    nothing of it. It names its tenant and database on stderr (stdout is the protocol)."""
    import subprocess

    env = _env(tmp_path)
    started = subprocess.run(
        [sys.executable, "-m", "keel", "mcp", "--tenant", "acme"],
        env=env,
        stdin=subprocess.DEVNULL,  # the client hangs up at once: the server ends
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert started.returncode == 0, started.stderr
    said = " ".join(started.stderr.split())
    assert f"tenant acme, database {env['KEEL_DATABASE']}" in said, started.stderr
    assert started.stdout == ""
