"""``POST /v1/approvals/{id}`` over real HTTP, on turns the service's agent really parked: the
decision resumes the turn and answers its reply; the tool's effects are counted."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import httpx
import pytest

from keel.approvals import ApprovalDecision, ApprovalRequest, ApprovalStatus
from tests.approvals.conftest import Approvals


def _park(client: httpx.Client, text: str, *, session: str = "s1", user: str = "alice") -> str:
    """Send ``text`` as a turn that parks on one request; its id."""
    reply = client.post(f"/v1/sessions/{session}/turns", json={"message": text, "user": user})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["status"] == "awaiting_approval", body
    (approval,) = body["approvals"]
    return str(approval["id"])


def test_an_operators_approval_resumes_the_turn_and_runs_the_call_once(
    approvals: Approvals,
) -> None:
    with approvals.client(approvals.keys.create("acme")) as operator:
        request_id = _park(operator, "refund W1 900")
        assert [item["id"] for item in operator.get("/v1/approvals").json()] == [request_id]
        assert approvals.effects == []
        decided = operator.post(f"/v1/approvals/{request_id}", json={"approve": True, "note": "ok"})
        assert decided.status_code == 200, decided.text
        reply = decided.json()
        assert reply["status"] == "completed" and "approved by operator:" in reply["text"]
        assert approvals.effects == ["refund W1 900"]
        # An HTTP retry of the same decision: answered, and nothing runs again.
        again = operator.post(f"/v1/approvals/{request_id}", json={"approve": True, "note": "ok"})
        assert again.status_code == 200, again.text
        assert again.json()["replayed"] is True
        assert approvals.effects == ["refund W1 900"]
        assert operator.get("/v1/approvals").json() == []
        standing = operator.get(f"/v1/approvals/{request_id}").json()
        assert standing["status"] == "approved"
        assert standing["decision"]["by"].startswith("operator:")


def test_a_rejection_tells_the_model_who_and_why_and_runs_nothing(approvals: Approvals) -> None:
    with approvals.client(approvals.keys.create("acme")) as operator:
        request_id = _park(operator, "refund W2 900")
        decided = operator.post(
            f"/v1/approvals/{request_id}", json={"approve": False, "note": "no receipt"}
        )
        assert decided.status_code == 200, decided.text
        text = decided.json()["text"]
        assert "rejected by operator:" in text and "no receipt" in text
    assert approvals.effects == []


def test_corrected_arguments_run_instead_and_bad_ones_are_refused(approvals: Approvals) -> None:
    with approvals.client(approvals.keys.create("acme")) as operator:
        request_id = _park(operator, "refund W3 900")
        bad = operator.post(
            f"/v1/approvals/{request_id}", json={"approve": True, "arguments": {"amount": "lots"}}
        )
        assert bad.status_code == 422, bad.text
        assert approvals.get("acme", request_id).status == "pending"  # type: ignore[union-attr]
        corrected = {"order": "W3", "amount": 400}
        decided = operator.post(
            f"/v1/approvals/{request_id}", json={"approve": True, "arguments": corrected}
        )
        assert decided.status_code == 200, decided.text
    assert approvals.effects == ["refund W3 400"]


def test_a_user_key_confirms_its_own_confirmation_only(approvals: Approvals) -> None:
    alice = approvals.keys.create("acme", user_id="alice")
    bob = approvals.keys.create("acme", user_id="bob")
    with approvals.client(alice) as client:
        confirm = _park(client, "cancel W4")
        refund = _park(client, "refund W5 900", session="s2")
        assert [item["id"] for item in client.get("/v1/approvals").json()] == [confirm]
    with approvals.client(bob) as client:
        assert client.post(f"/v1/approvals/{confirm}", json={"approve": True}).status_code == 404
    with approvals.client(alice) as client:
        # An operator's approval, even of her own call, is not hers to give.
        assert client.post(f"/v1/approvals/{refund}", json={"approve": True}).status_code == 404
        decided = client.post(f"/v1/approvals/{confirm}", json={"approve": True})
        assert decided.status_code == 200, decided.text
        assert "approved by user:alice" in decided.json()["text"]
    assert approvals.effects == ["cancel W4"]
    assert approvals.get("acme", refund).status == "pending"  # type: ignore[union-attr]


def test_two_operators_deciding_at_once_settle_it_once(approvals: Approvals) -> None:
    key = approvals.keys.create("acme")
    with approvals.client(key) as operator:
        request_id = _park(operator, "refund W6 900")
    barrier = threading.Barrier(2)
    answers: list[httpx.Response] = []

    def decide(verdict: dict[str, Any]) -> None:
        with approvals.client(key) as client:
            barrier.wait()
            answers.append(client.post(f"/v1/approvals/{request_id}", json=verdict))

    threads = [
        threading.Thread(target=decide, args=({"approve": approve},)) for approve in (True, False)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(answer.status_code for answer in answers) == [200, 409], [a.text for a in answers]
    standing = approvals.get("acme", request_id)
    assert standing is not None and standing.status in ("approved", "rejected")
    (refused,) = [answer.json() for answer in answers if answer.status_code == 409]
    assert refused["approval"]["status"] == standing.status
    ran = ["refund W6 900"] if standing.status == "approved" else []
    assert approvals.effects == ran


def _settled(answer: httpx.Response) -> dict[str, Any]:
    """The request as it stands, from a 409 answering a decision that did not take effect."""
    assert answer.status_code == 409, answer.text
    body: dict[str, Any] = answer.json()
    assert body["error"]["type"] == "ApprovalSettled"
    assert "this decision did not take effect" in body["error"]["message"]
    approval: dict[str, Any] = body["approval"]
    return approval


def _decider(approvals: Approvals, request_id: str) -> str:
    found = approvals.get("acme", request_id)
    assert found is not None and found.decision is not None
    return found.decision.by


def test_a_rejection_after_an_approval_is_409_with_the_approval_that_stands(
    approvals: Approvals,
) -> None:
    olga, ivan = approvals.keys.create("acme"), approvals.keys.create("acme")
    with approvals.client(olga) as operator:
        request_id = _park(operator, "refund W8 900")
        approved = operator.post(f"/v1/approvals/{request_id}", json={"approve": True})
        assert approved.status_code == 200, approved.text
    with approvals.client(ivan) as other:
        late = other.post(f"/v1/approvals/{request_id}", json={"approve": False, "note": "no"})
        standing = _settled(late)
        # The same verdict from another operator is another decision: refused as well.
        also = _settled(other.post(f"/v1/approvals/{request_id}", json={"approve": True}))
    assert standing["status"] == also["status"] == "approved"
    assert standing["decision"]["by"] == _decider(approvals, request_id)
    assert standing["decision"]["approve"] is True
    assert approvals.effects == ["refund W8 900"]


def test_a_decision_on_a_request_a_revert_cancelled_is_409(approvals: Approvals) -> None:
    with approvals.client(approvals.keys.create("acme")) as operator:
        first = operator.post("/v1/sessions/s8/turns", json={"message": "hi", "user": "alice"})
        assert first.status_code == 200, first.text
        parked = operator.post(
            "/v1/sessions/s8/turns", json={"message": "refund W9 900", "user": "alice"}
        )
        (request_id,) = [item["id"] for item in parked.json()["approvals"]]
        revert = {
            "version": first.json()["state_version"],
            "expected_version": parked.json()["state_version"],
        }
        assert operator.post("/v1/sessions/s8/revert", json=revert).status_code == 200
        standing = _settled(operator.post(f"/v1/approvals/{request_id}", json={"approve": True}))
    assert standing["status"] == "cancelled" and standing["decision"] is None
    assert "reverted" in standing["status_reason"]
    assert approvals.effects == []


def test_the_loser_of_a_race_is_409_with_the_winners_decision(
    approvals: Approvals, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The approval reads the request pending, then is held at its compare-and-set until a
    rejection has settled the request: the approval lost the race, whatever the timing."""
    olga, ivan = approvals.keys.create("acme"), approvals.keys.create("acme")
    with approvals.client(olga) as operator:
        request_id = _park(operator, "refund W10 900")
    approval_at_its_write = threading.Event()
    rejection_settled = threading.Event()
    decide = approvals.store.adecide

    async def ordered(
        tenant_id: str, approval_id: str, status: ApprovalStatus, decision: ApprovalDecision
    ) -> tuple[ApprovalRequest, bool]:
        if decision.approve:
            approval_at_its_write.set()
            assert await asyncio.to_thread(rejection_settled.wait, 60)
            return await decide(tenant_id, approval_id, status, decision)
        outcome = await decide(tenant_id, approval_id, status, decision)
        rejection_settled.set()
        return outcome

    monkeypatch.setattr(approvals.store, "adecide", ordered)
    answers: list[httpx.Response] = []

    def approve() -> None:
        with approvals.client(olga) as client:
            answers.append(client.post(f"/v1/approvals/{request_id}", json={"approve": True}))

    approving = threading.Thread(target=approve)
    approving.start()
    assert approval_at_its_write.wait(60)
    with approvals.client(ivan) as other:
        rejected = other.post(f"/v1/approvals/{request_id}", json={"approve": False, "note": "no"})
    approving.join()
    assert rejected.status_code == 200, rejected.text
    assert "rejected by operator:" in rejected.json()["text"]
    (lost,) = answers
    standing = _settled(lost)
    assert (standing["status"], standing["decision"]["approve"]) == ("rejected", False)
    assert standing["decision"]["note"] == "no"
    assert approvals.effects == []


def test_an_escalated_turn_is_answered_with_an_action(approvals: Approvals) -> None:
    with approvals.client(approvals.keys.create("acme")) as operator:
        stopped = operator.post("/v1/sessions/s7/turns", json={"message": "hold W7", "user": "u"})
        assert stopped.status_code == 200, stopped.text
        assert stopped.json()["status"] == "escalated"
        (escalation,) = stopped.json()["approvals"]
        listed = operator.get("/v1/approvals").json()
        assert [(item["id"], item["kind"]) for item in listed] == [(escalation["id"], "escalation")]
        bad = operator.post(
            f"/v1/approvals/{escalation['id']}", json={"approve": True, "action": "undo"}
        )
        assert bad.status_code == 422
        answered = operator.post(
            f"/v1/approvals/{escalation['id']}",
            json={"approve": True, "action": "skip", "note": "leave it on hold"},
        )
        assert answered.status_code == 200, answered.text
        assert (
            "skip the stopped step and go on without it: leave it on hold"
            in (answered.json()["text"])
        )
    assert approvals.effects == ["hold W7"]
