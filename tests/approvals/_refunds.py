"""A refund tool behind an operator's approval, and what a scripted model answers once its turn
goes on: shared by the tests that carry decisions out (embedded, served, from the viewer)."""

from __future__ import annotations

from typing import Any

from keel.testing import ScriptedCall
from keel.tools import tool


def told(call: ScriptedCall) -> str:
    """The model's answer once the turn goes on: what keel told it of the decision."""
    notes = [m.content for m in call.messages if m.role == "system" and "approval" in m.content]
    return "Done. " + (notes[-1] if notes else "nothing")


def refund_tool(refunds: list[str], **options: Any) -> Any:
    """``issue_refund`` behind an operator's approval; each refund made is appended to
    ``refunds`` (the effect the tests count)."""

    @tool(approval="operator", **options)
    def issue_refund(order_id: str, amount: float) -> str:
        """Refund an order.

        Args:
            order_id: The order.
            amount: Euros.
        """
        refunds.append(f"{order_id} {amount}")
        return f"refunded {amount} on {order_id}"

    return issue_refund
