"""Shared parts of the approvals tests: the service, built as ``keel serve`` builds it, on
uvicorn over real HTTP, and its approvals queue."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from keel.approvals import ApprovalRequest, ApprovalStore
from keel.service import APIKeys, build_service
from keel.settings import load_settings
from keel.testing import ScriptedModel
from keel.testing.approvals_conformance import request
from tests.service.conftest import serving


@dataclass
class Approvals:
    url: str
    keys: APIKeys
    store: ApprovalStore

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


@pytest.fixture
def approvals(tmp_path: Path) -> Iterator[Approvals]:
    settings = load_settings(data_dir=tmp_path)
    app, agents, keys = build_service(
        f"sqlite:///{tmp_path / 'keel.db'}",
        model=ScriptedModel(lambda call: "ok"),
        memory=False,
        settings=settings,
    )
    store = agents.backends.approvals
    with serving(app) as running:
        yield Approvals(running.url, keys, store)
    agents.backends.close()


def add_queue(approvals: Approvals) -> None:
    """acme: an operator approval and two users' confirmations; another tenant's request."""
    approvals.add(
        request("op-alice", created_at=1.0),
        request("confirm-alice", created_at=2.0, kind="user", tool="cancel_order"),
        request("confirm-bob", created_at=3.0, kind="user", user_id="bob", session_id="s2"),
        request("theirs", tenant_id="evil-corp", created_at=4.0, kind="user"),
    )
