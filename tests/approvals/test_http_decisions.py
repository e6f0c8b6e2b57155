"""``POST /v1/approvals/{id}`` over real HTTP, on turns the service's agent really parked: the
decision resumes the turn and answers its reply; the tool's effects are counted."""

from __future__ import annotations

import threading
from typing import Any

import httpx

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
    assert [answer.status_code for answer in answers] == [200, 200], [a.text for a in answers]
    standing = approvals.get("acme", request_id)
    assert standing is not None and standing.status in ("approved", "rejected")
    ran = ["refund W6 900"] if standing.status == "approved" else []
    assert approvals.effects == ran


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
