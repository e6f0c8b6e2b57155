"""The viewer's approvals page over real HTTP: the tenant's pending queue, and its forms."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import httpx

from keel.ui import COOKIE
from tests.approvals.conftest import Approvals, add_queue


@contextlib.contextmanager
def _signed_in(approvals: Approvals, tenant: str) -> Iterator[httpx.Client]:
    key = approvals.keys.create(tenant)
    with httpx.Client(base_url=approvals.url, timeout=30, follow_redirects=False) as client:
        signed = client.post("/ui/login", data={"key": key, "next": "/ui/approvals"})
        assert signed.status_code == 303 and COOKIE in signed.cookies
        yield client


def test_the_page_shows_the_tenants_pending_queue_with_a_form_each(approvals: Approvals) -> None:
    add_queue(approvals)
    with _signed_in(approvals, "acme") as client:
        page = client.get("/ui/approvals")
    assert page.status_code == 200
    assert 'href="/ui/approvals"' in page.text  # in the navigation
    for request_id in ("op-alice", "confirm-alice", "confirm-bob"):
        assert f'action="/ui/approvals/{request_id}"' in page.text
    assert "refunds over 500 need an operator" in page.text
    assert "theirs" not in page.text
    with _signed_in(approvals, "evil-corp") as client:
        theirs = client.get("/ui/approvals").text
    assert 'action="/ui/approvals/theirs"' in theirs and "op-alice" not in theirs


def test_the_page_needs_a_signed_in_key(approvals: Approvals) -> None:
    with httpx.Client(base_url=approvals.url, timeout=30, follow_redirects=False) as client:
        assert client.get("/ui/approvals").status_code == 303
        decided = client.post("/ui/approvals/op-alice", data={"verdict": "approve"})
        assert decided.status_code == 303
    add_queue(approvals)
    stored = approvals.get("acme", "op-alice")
    assert stored is not None and stored.status == "pending"


def test_another_tenants_request_is_missing_and_left_pending(approvals: Approvals) -> None:
    add_queue(approvals)
    with _signed_in(approvals, "acme") as client:
        answer = client.post("/ui/approvals/theirs", data={"verdict": "approve"})
    assert answer.status_code == 404 and "Not found" in answer.text
    stored = approvals.get("evil-corp", "theirs")
    assert stored is not None and stored.status == "pending"


def test_corrected_arguments_that_are_not_an_object_decide_nothing(approvals: Approvals) -> None:
    add_queue(approvals)
    with _signed_in(approvals, "acme") as client:
        for bad in ("{not json", "[1, 2]"):
            answer = client.post(
                "/ui/approvals/op-alice", data={"verdict": "approve", "arguments": bad}
            )
            assert answer.status_code == 200
            assert "must be a JSON object: nothing was decided" in answer.text
    stored = approvals.get("acme", "op-alice")
    assert stored is not None and stored.status == "pending"


def test_an_escalation_is_answered_from_the_page_with_an_action(approvals: Approvals) -> None:
    with approvals.client(approvals.keys.create("acme")) as api:
        stopped = api.post("/v1/sessions/s7/turns", json={"message": "hold W7", "user": "u"})
        (escalation,) = stopped.json()["approvals"]
    with _signed_in(approvals, "acme") as client:
        page = client.get("/ui/approvals")
        assert 'select name="action"' in page.text and "escalated turn" in page.text
        answer = client.post(
            f"/ui/approvals/{escalation['id']}",
            data={"verdict": "approve", "action": "retry", "note": "try once more"},
        )
    assert answer.status_code == 200
    assert f"Approved {escalation['id']}" in answer.text
    assert "answered by operator:" in answer.text and "try again" in answer.text


def test_a_decision_that_did_not_take_effect_says_the_outcome_that_stands(
    approvals: Approvals,
) -> None:
    with approvals.client(approvals.keys.create("acme")) as api:
        parked = api.post("/v1/sessions/s9/turns", json={"message": "refund W9 900", "user": "u"})
        (waiting,) = parked.json()["approvals"]
    with _signed_in(approvals, "acme") as client:
        first = client.post(f"/ui/approvals/{waiting['id']}", data={"verdict": "approve"})
        assert f"Approved {waiting['id']}" in first.text
        late = client.post(
            f"/ui/approvals/{waiting['id']}", data={"verdict": "reject", "note": "no"}
        )
    assert late.status_code == 200
    assert f"{waiting['id']} was not decided" in late.text and "already approved by" in late.text
    assert approvals.effects == ["refund W9 900"]
