"""Shared parts of the approvals tests: the service, built as ``keel serve`` builds it, on
uvicorn over real HTTP, and its approvals queue."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from keel.approvals import ApprovalRequest, ApprovalStore
from keel.messages import Message
from keel.service import APIKeys, build_service
from keel.settings import load_settings
from keel.testing import ScriptedCall, ScriptedModel
from keel.testing.approvals_conformance import request
from keel.tools import Tool, tool
from tests.service.conftest import serving


@dataclass
class Approvals:
    url: str
    keys: APIKeys
    store: ApprovalStore
    effects: list[str] = field(default_factory=list)
    """What the service's tools did: ``refund ORDER AMOUNT`` / ``cancel ORDER`` / ``hold ORDER``."""
    release: threading.Event = field(default_factory=threading.Event)
    """Lets ``hold``, whose answer never comes in time, return (at teardown)."""

    def client(self, key: str) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {key}"}, timeout=30
        )

    def add(self, *requests: ApprovalRequest) -> None:
        async def add() -> None:
            for made in requests:
                await self.store.aadd(made)

        asyncio.run(add())

    def get(self, tenant: str, request_id: str) -> ApprovalRequest | None:
        return asyncio.run(self.store.aget(tenant, request_id))


def _shop_tools(effects: list[str], release: threading.Event) -> list[Tool]:
    @tool(approval="operator")
    def refund(order: str, amount: int) -> str:
        """Refund an order.

        Args:
            order: The order.
            amount: Euros.
        """
        effects.append(f"refund {order} {amount}")
        return f"refunded {amount} on {order}"

    @tool(approval="user")
    def cancel(order: str) -> str:
        """Cancel an order.

        Args:
            order: The order.
        """
        effects.append(f"cancel {order}")
        return f"cancelled {order}"

    @tool(side_effect=True, idempotent=False, timeout_s=0.2)
    def hold(order: str) -> str:
        """Put an order on hold (the shop's answer never comes in time: left in doubt).

        Args:
            order: The order.
        """
        effects.append(f"hold {order}")
        release.wait(30)
        return f"held {order}"

    return [refund, cancel, hold]


def _shop_model(call: ScriptedCall) -> Message | str:
    """``refund ORDER AMOUNT`` / ``cancel ORDER`` / ``hold ORDER``: calls the tool; then says
    what keel told it last."""
    words = call.last_user_text.split()
    if call.messages[-1].role == "user" and words and words[0] in ("refund", "cancel", "hold"):
        arguments: dict[str, Any] = {"order": words[1]}
        if words[0] == "refund":
            arguments["amount"] = int(words[2])
        return ScriptedModel.tool_call(words[0], json.dumps(arguments))
    notes = [
        m.content
        for m in call.messages
        if m.role == "system" and ("approval" in m.content or "operator" in m.content)
    ]
    return "Told: " + (notes[-1] if notes else "nothing")


@pytest.fixture
def approvals(tmp_path: Path) -> Iterator[Approvals]:
    """The service ``keel serve`` builds, its agents with a refund an operator approves, a
    cancellation the user confirms, and a hold left in doubt that escalates."""
    settings = load_settings(data_dir=tmp_path)
    effects: list[str] = []
    release = threading.Event()
    app, agents, keys = build_service(
        f"sqlite:///{tmp_path / 'keel.db'}",
        model=ScriptedModel(_shop_model),
        tools=_shop_tools(effects, release),
        memory=False,
        settings=settings,
        escalate=True,
    )
    store = agents.backends.approvals
    try:
        with serving(app) as running:
            yield Approvals(running.url, keys, store, effects, release)
    finally:
        release.set()
        agents.backends.close()


def add_queue(approvals: Approvals) -> None:
    """acme: an operator approval and two users' confirmations; another tenant's request."""
    approvals.add(
        request("op-alice", created_at=1.0),
        request("confirm-alice", created_at=2.0, kind="user", tool="cancel_order"),
        request("confirm-bob", created_at=3.0, kind="user", user_id="bob", session_id="s2"),
        request("theirs", tenant_id="evil-corp", created_at=4.0, kind="user"),
    )
