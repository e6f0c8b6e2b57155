"""A parked turn through the service (issue 37): the OpenAI facade answers it with the waiting
message (``finish_reason: "stop"``) and keel's status in the ``keel`` field; an operator's
``POST /v1/approvals/{id}`` resumes it and the approved call runs once."""

from __future__ import annotations

from pathlib import Path

import httpx

from keel.messages import Message
from keel.service import build_service
from keel.settings import load_settings
from keel.testing import ScriptedCall, ScriptedModel
from keel.tools import tool
from tests.service.conftest import serving


def test_a_parked_turn_is_answered_then_resumed_by_an_operator(tmp_path: Path) -> None:
    refunds: list[str] = []

    @tool(approval=True)
    def refund(order: str) -> str:
        """Refund an order.

        Args:
            order: The order id.
        """
        refunds.append(order)
        return f"refunded {order}"

    def answer(call: ScriptedCall) -> Message | str:
        if call.messages[-1].role == "system":
            return "Refund done."
        return ScriptedModel.tool_call("refund", '{"order": "W1"}')

    app, agents, keys = build_service(
        f"sqlite:///{tmp_path / 'keel.db'}",
        model=ScriptedModel(answer),
        tools=[refund],
        memory=False,
        settings=load_settings(data_dir=tmp_path),
    )
    user, operator = keys.create("acme", user_id="u1"), keys.create("acme")
    with serving(app) as running:
        headers = {"Authorization": f"Bearer {user}", "X-Keel-Session": "s1", "X-Keel-User": "u1"}
        with httpx.Client(base_url=running.url, headers=headers, timeout=30) as client:
            body = {"model": "keel", "messages": [{"role": "user", "content": "Refund W1."}]}
            parked = client.post("/v1/chat/completions", json=body)
        assert parked.status_code == 200, parked.text
        completion = parked.json()
        [choice] = completion["choices"]
        assert choice["finish_reason"] == "stop"
        # Written for the customer: the tool and its arguments are the operator's (issue 45).
        assert choice["message"]["content"].startswith("I need a colleague to approve this")
        assert "{" not in choice["message"]["content"]
        assert completion["keel"]["status"] == "awaiting_approval" and refunds == []
        [approval] = completion["keel"]["approvals"]
        headers = {"Authorization": f"Bearer {operator}"}
        with httpx.Client(base_url=running.url, headers=headers, timeout=30) as client:
            decided = client.post(f"/v1/approvals/{approval['id']}", json={"approve": True})
        assert decided.status_code == 200, decided.text
        assert decided.json()["status"] == "completed" and refunds == ["W1"]
    agents.backends.close()
