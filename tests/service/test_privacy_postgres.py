"""The service with a PII vault on PostgreSQL (a real server): after turns whose user text, tool
output and model output carry every kind of PII, no table holds a raw value (every column of
every table read back with psycopg), and the vault's tables hold ciphertext only."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import httpx

from keel.bench.privacy import pii_value
from keel.messages import Message
from keel.privacy import ENTITY_TYPES, MasterKey
from keel.service import build_service
from keel.settings import load_settings
from keel.testing import ScriptedCall, ScriptedModel
from keel.tools import tool
from tests.service.conftest import serving


def _every_kind(rng: random.Random) -> list[tuple[str, str]]:
    """One ``(value, sentence)`` of every kind of PII the masker finds."""
    return [pii_value(kind, rng) for kind in ENTITY_TYPES]


def _cells(postgres_url: str) -> dict[str, list[Any]]:
    """Every cell of every table of the database, by table."""
    import psycopg

    with psycopg.connect(postgres_url, autocommit=True) as conn:
        tables = [
            row[0]
            for row in conn.execute(
                "SELECT table_name FROM information_schema.tables "
                "WHERE table_schema = 'public' AND table_type = 'BASE TABLE'"
            )
        ]
        return {
            table: [cell for row in conn.execute(f'SELECT * FROM "{table}"') for cell in row]
            for table in tables
        }


def _holds(cell: Any, value: str) -> bool:
    if isinstance(cell, bytes | memoryview):
        return value.encode() in bytes(cell)
    return value in json.dumps(cell, default=str, ensure_ascii=False)


def test_no_table_holds_a_raw_value_after_turns_carrying_every_kind(
    tmp_path: Path, postgres_url: str
) -> None:
    rng = random.Random(36)
    user_side, tool_side, model_side = _every_kind(rng), _every_kind(rng), _every_kind(rng)
    received: list[str] = []

    @tool
    def lookup_profile(query: str) -> str:
        """The customer's profile.

        Args:
            query: What the customer wrote.
        """
        received.append(query)
        return "Profile: " + "; ".join(sentence for _, sentence in tool_side)

    def policy(call: ScriptedCall) -> Message | str:
        last = call.messages[-1]
        if last.role == "tool":
            return f"{last.content}. Also: " + "; ".join(s for _, s in model_side)
        return ScriptedModel.tool_call("lookup_profile", json.dumps({"query": last.content}))

    settings = load_settings(
        data_dir=tmp_path, embedder="hashing:64", pii_key=MasterKey.new_key_text()
    )
    app, _, keys = build_service(
        postgres_url,
        model=ScriptedModel(policy),
        tools=[lookup_profile],
        memory=True,
        settings=settings,
    )
    message = "Here: " + "; ".join(sentence for _, sentence in user_side)
    with serving(app) as running:
        headers = {"Authorization": f"Bearer {keys.create('acme', 'ada')}"}
        with httpx.Client(base_url=running.url, headers=headers, timeout=60) as ada:
            for session in ("s1", "s2"):
                body = {"message": message, "user": "ada"}
                reply = ada.post(f"/v1/sessions/{session}/turns", json=body)
                assert reply.status_code == 200, reply.text
    # The tool got the values; the user read them, the model's included.
    assert received == [message, message]
    assert all(value in reply.json()["text"] for value, _ in tool_side + model_side)

    cells = _cells(postgres_url)
    assert cells["keel_pii_values"], "the vault holds nothing"
    raw = [value for value, _ in user_side + tool_side + model_side]
    leaks = [
        (table, value)
        for table, found in cells.items()
        for cell in found
        for value in raw
        if _holds(cell, value)
    ]
    assert leaks == []
