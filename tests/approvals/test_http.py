"""``/v1/approvals`` over real HTTP: who sees which requests, and who may decide them."""

from __future__ import annotations

from typing import Any

import httpx

from tests.approvals.conftest import Approvals, add_queue


def _ids(response: httpx.Response) -> list[str]:
    assert response.status_code == 200, response.text
    return [item["id"] for item in response.json()]


def test_an_operator_key_lists_the_tenants_queue(approvals: Approvals) -> None:
    add_queue(approvals)
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
    add_queue(approvals)
    with approvals.client(approvals.keys.create("acme", user_id="alice")) as client:
        assert _ids(client.get("/v1/approvals")) == ["confirm-alice"]
        assert client.get("/v1/approvals", params={"user": "bob"}).status_code == 403
        assert client.get("/v1/approvals/confirm-alice").status_code == 200
        # An operator's approval of alice's own call, and bob's confirmation: not hers to see.
        assert client.get("/v1/approvals/op-alice").status_code == 404
        assert client.get("/v1/approvals/confirm-bob").status_code == 404


def test_a_key_that_may_not_decide_gets_404_and_nothing_changes(approvals: Approvals) -> None:
    add_queue(approvals)
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
    add_queue(approvals)
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
