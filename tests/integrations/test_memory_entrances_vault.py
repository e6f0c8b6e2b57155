"""Every way into memory masks through the user's vault (issue 44, defect 2 and the class it
belongs to): a new address of a user who already has one stored is numbered as their second,
and reads back as itself. Masked without the vault (``keel mcp``'s ``remember``,
``Memory.add`` called directly, the LangGraph store) it became ``<EMAIL_1>``, which is the
user's *first* address: a tool would have been given that one."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from mcp import Client, StdioServerParameters

from keel.memory import Scope
from keel.privacy import MasterKey
from keel.service import build_service
from keel.settings import load_settings
from keel.stores import Backends
from keel.testing import ScriptedModel
from tests.service.conftest import serving

TENANT = "acme"
USER = "u1"
FIRST = "first@old.example"
SECOND = "second@new.example"
NOTE = f"My new billing address is {SECOND}"


@pytest.fixture
def key_text() -> str:
    return MasterKey.new_key_text()


@pytest.fixture
def database(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'keel.db'}"


def _open(database: str, tmp_path: Path, key_text: str) -> Backends:
    settings = load_settings(data_dir=tmp_path / "data", embedder="hashing:64")
    return Backends.open(
        database, settings=settings, background=False, pii_key=MasterKey.from_text(key_text)
    )


@pytest.fixture
def backends(database: str, tmp_path: Path, key_text: str) -> Iterator[Backends]:
    """The stores with a vault, the user's first address already in it (``<EMAIL_1>``)."""
    opened = _open(database, tmp_path, key_text)
    try:
        assert opened.vault is not None
        assert opened.vault.user(TENANT, USER).placeholder("EMAIL", FIRST) == "<EMAIL_1>"
        yield opened
    finally:
        opened.close()


def _read_back(backends: Backends, stored: str) -> str:
    """``stored`` as the user reads it: their placeholders revealed from the vault."""
    assert backends.vault is not None
    assert SECOND not in stored, "the new address reached storage unmasked"
    revealed = backends.vault.user(TENANT, USER).reveal(stored)
    assert FIRST not in revealed, (
        f"the user's new address reads back as their first one: stored {stored!r}, "
        f"read back {revealed!r}"
    )
    return revealed


def test_memory_add_numbers_a_new_value_in_the_users_vault(backends: Backends) -> None:
    memory = backends.memory
    assert memory is not None
    scope = Scope(tenant_id=TENANT, user_id=USER)
    record = memory.add(NOTE, scope=scope)
    assert _read_back(backends, record.text) == NOTE
    fact = memory.remember_fact(scope, "user", "billing email", SECOND)
    assert _read_back(backends, json.dumps(fact.metadata)) == json.dumps({"value": SECOND})


async def test_keel_mcp_remember_numbers_a_new_value_in_the_users_vault(
    tmp_path: Path, database: str, key_text: str
) -> None:
    with _open(database, tmp_path, key_text) as placed:
        assert placed.vault is not None
        placed.vault.user(TENANT, USER).placeholder("EMAIL", FIRST)
    env = {
        **os.environ,
        "KEEL_DATA_DIR": str(tmp_path / "data"),
        "KEEL_EMBEDDER": "hashing:64",
        "KEEL_DATABASE": database,
        "KEEL_PII_KEY": key_text,
    }
    server = StdioServerParameters(
        command=sys.executable, args=["-m", "keel", "mcp", "--tenant", TENANT], env=env
    )
    async with Client(server) as client:
        result = await client.call_tool("remember", {"user": USER, "text": NOTE})
        assert not result.is_error, result.content
        content: Any = result.structured_content
        note = content.get("result", content) if isinstance(content, dict) else None
        assert isinstance(note, dict), result.content
    with _open(database, tmp_path, key_text) as reading:
        assert _read_back(reading, note["text"]) == NOTE


def test_the_http_memory_route_numbers_a_new_value_in_the_users_vault(
    tmp_path: Path, database: str, key_text: str
) -> None:
    settings = load_settings(data_dir=tmp_path / "data", embedder="hashing:64", pii_key=key_text)
    app, agents, keys = build_service(
        database, model=ScriptedModel(["ok"]), memory=True, settings=settings
    )
    assert agents.backends.vault is not None
    agents.backends.vault.user(TENANT, USER).placeholder("EMAIL", FIRST)
    with serving(app) as running:
        headers = {"Authorization": f"Bearer {keys.create(TENANT)}"}
        with httpx.Client(base_url=running.url, headers=headers, timeout=30) as operator:
            added = operator.post("/v1/memory", json={"user": USER, "text": NOTE})
            assert added.status_code == 201, added.text
            stored = added.json()["text"]
        assert _read_back(agents.backends, stored) == NOTE


def test_the_langgraph_store_numbers_a_new_value_and_reads_it_back(backends: Backends) -> None:
    from keel.integrations.langgraph import KeelStore

    assert backends.memory is not None
    store = KeelStore(backends.memory, tenant=TENANT, user=USER)
    store.put(("contacts",), "billing", {"email": SECOND})
    item = store.get(("contacts",), "billing")
    assert item is not None
    assert item.value == {"email": SECOND}, f"the item put with {SECOND} reads back as {item.value}"
    [record] = backends.memory.store.list_records(
        Scope(tenant_id=TENANT, user_id=USER), _item_records(), limit=10
    )
    assert _read_back(backends, json.dumps(record.metadata["value"])) == json.dumps(
        {"email": SECOND}
    )


def _item_records() -> Any:
    from keel.memory import MemoryFilter

    return MemoryFilter(types=("langgraph",))
