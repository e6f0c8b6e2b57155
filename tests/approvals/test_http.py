"""``/v1/approvals`` over real HTTP: who sees which requests, and who may decide them."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


def _queue(approvals: Approvals) -> None:
    approvals.add(
        request("op-alice", created_at=1.0),
        request("confirm-alice", created_at=2.0, kind="user", tool="cancel_order"),
        request("confirm-bob", created_at=3.0, kind="user", user_id="bob", session_id="s2"),
        request("theirs", tenant_id="evil-corp", created_at=4.0, kind="user"),
    )


def _ids(response: httpx.Response) -> list[str]:
    assert response.status_code == 200, response.text
    return [item["id"] for item in response.json()]


def test_an_operator_key_lists_the_tenants_queue(approvals: Approvals) -> None:
    _queue(approvals)
    with approvals.client(approvals.keys.create("acme")) as client:
        assert _ids(client.get("/v1/approvals")) == ["op-alice", "confirm-alice", "confirm-bob"]
        assert _ids(client.get("/v1/approvals", params={"user": "bob"})) == ["confirm-bob"]
        assert _ids(client.get("/v1/approvals", params={"session": "s2"})) == ["confirm-bob"]
        first = client.get("/v1/approvals", params={"limit": 2})
        assert _ids(first) == ["op-alice", "confirm-alice"]
        rest = client.get(
            "/v1/approvals", params={"limit": 2, "cursor": first.headers["X-Next-Cursor"]}
        )
        assert _ids(rest) == ["confirm-bob"] and "X-Next-Cursor" not in rest.headers
        item = client.get("/v1/approvals/op-alice").json()
        assert (item["tool"], item["reason"]) == ("refund", "refunds over 500 need an operator")
        assert client.get("/v1/approvals", params={"status": "waiting"}).status_code == 422


def test_a_user_key_lists_only_its_own_confirmations(approvals: Approvals) -> None:
    _queue(approvals)
    with approvals.client(approvals.keys.create("acme", user_id="alice")) as client:
        assert _ids(client.get("/v1/approvals")) == ["confirm-alice"]
        assert client.get("/v1/approvals", params={"user": "bob"}).status_code == 403
        assert client.get("/v1/approvals/confirm-alice").status_code == 200
        # An operator's approval of alice's own call, and bob's confirmation: not hers to see.
        assert client.get("/v1/approvals/op-alice").status_code == 404
        assert client.get("/v1/approvals/confirm-bob").status_code == 404


def test_a_key_that_may_not_decide_gets_404_and_nothing_changes(approvals: Approvals) -> None:
    _queue(approvals)
    verdict = {"approve": True, "note": "fine"}
    cases = (
        (approvals.keys.create("acme", user_id="alice"), "op-alice"),
        (approvals.keys.create("acme", user_id="alice"), "confirm-bob"),
        (approvals.keys.create("acme", user_id="bob"), "confirm-alice"),
        (approvals.keys.create("acme"), "theirs"),
        (approvals.keys.create("acme"), "missing"),
    )
    for key, request_id in cases:
        with approvals.client(key) as client:
            answer = client.post(f"/v1/approvals/{request_id}", json=verdict)
        assert answer.status_code == 404, (request_id, answer.text)
        assert answer.json() == {"error": {"type": "NotFound", "message": "not found"}}
    for tenant, request_id in (
        ("acme", "op-alice"),
        ("acme", "confirm-bob"),
        ("acme", "confirm-alice"),
        ("evil-corp", "theirs"),
    ):
        stored = approvals.get(tenant, request_id)
        assert stored is not None and stored.status == "pending", request_id


def test_a_bad_verdict_is_422(approvals: Approvals) -> None:
    _queue(approvals)
    with approvals.client(approvals.keys.create("acme")) as client:
        for body in ({}, {"approve": "perhaps"}, {"approve": True, "arguments": "[1]"},
                     {"approve": True, "extra": 1}):  # fmt: skip
            assert client.post("/v1/approvals/op-alice", json=body).status_code == 422, body
    stored = approvals.get("acme", "op-alice")
    assert stored is not None and stored.status == "pending"


def test_the_routes_are_in_the_openapi_schema(approvals: Approvals) -> None:
    schema: dict[str, Any] = httpx.get(f"{approvals.url}/openapi.json").json()
    assert set(schema["paths"]["/v1/approvals"]) == {"get"}
    assert set(schema["paths"]["/v1/approvals/{approval_id}"]) == {"get", "post"}
    post = schema["paths"]["/v1/approvals/{approval_id}"]["post"]
    assert "resumes" in post["description"]
    assert "ApprovalVerdict" in str(post["requestBody"])
