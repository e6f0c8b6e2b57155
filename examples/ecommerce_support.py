"""The seeds' e-commerce support agent: order lookup, refunds an operator approves, cancel,
change address, and the race.

Serve it: ``keel serve --agent examples.ecommerce_support:build`` (from the repository's root):
:func:`build` is the customer-support agent, on the settings' database and model, with
``lookup_order`` (by e-mail or order number) and ``issue_refund``, which waits for an
operator's approval (``keel approvals approve ID``, or ``POST /v1/approvals/ID``).

Run the race: ``.venv/bin/python examples/ecommerce_support.py``. Two agent instances handle
"cancel order 1024" and "change the shipping address first" at the same time. Orders carry a
version and every change is compare-and-set on the version the agent read: exactly one change
commits; the other agent gets a conflict, re-reads the order, sees it cancelled and tells the
customer the address can't be changed.
"""

from __future__ import annotations

import asyncio
import json
import re
import sqlite3
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from keel.errors import ConflictError
from keel.messages import Message
from keel.runtime import Agent
from keel.settings import Settings, load_settings
from keel.state import AgentState, StateStore
from keel.stores import SQLiteDatabase, SQLStateBackend, SQLToolJournal
from keel.testing import ScriptedCall, ScriptedModel
from keel.tools import Tool, tool


class Shop:
    """Orders with a version column: every write states the version it read."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self._lock = threading.Lock()
        with self._connect() as conn:
            conn.execute(
                "CREATE TABLE IF NOT EXISTS orders (id TEXT PRIMARY KEY, status TEXT, "
                "address TEXT, version INTEGER, email TEXT, total REAL)"
            )
            conn.execute(
                "CREATE TABLE IF NOT EXISTS refunds (order_id TEXT, amount REAL, reason TEXT)"
            )
            conn.execute(
                "INSERT OR IGNORE INTO orders VALUES "
                "('1024', 'paid', '1 Old Road', 1, 'ada@example.com', 40.0)"
            )

    def _connect(self) -> sqlite3.Connection:
        return sqlite3.connect(self.path, timeout=10)

    def get(self, order_id: str) -> dict[str, Any]:
        with self._connect() as conn:
            row = conn.execute(
                "SELECT id, status, address, version FROM orders WHERE id = ?", (order_id,)
            ).fetchone()
        if row is None:
            raise LookupError(f"no order {order_id}")
        return {"id": row[0], "status": row[1], "address": row[2], "version": row[3]}

    def find(self, email_or_order_id: str) -> list[dict[str, Any]]:
        """The orders of an e-mail address, or the one order of that number."""
        with self._connect() as conn:
            rows = conn.execute(
                "SELECT id, status, total, email FROM orders WHERE id = ? OR lower(email) = ?",
                (email_or_order_id, email_or_order_id.strip().lower()),
            ).fetchall()
        return [{"id": r[0], "status": r[1], "total": r[2], "email": r[3]} for r in rows]

    def refund(self, order_id: str, amount: float, reason: str) -> None:
        """Pay ``amount`` of the order back (a row in ``refunds``: the refund's effect)."""
        with self._connect() as conn:
            conn.execute("INSERT INTO refunds VALUES (?, ?, ?)", (order_id, amount, reason))

    def refunds(self) -> list[tuple[str, float, str]]:
        """Every refund paid, in order."""
        with self._connect() as conn:
            return list(conn.execute("SELECT order_id, amount, reason FROM refunds ORDER BY rowid"))

    def update(self, order_id: str, expected_version: int, **changes: str) -> dict[str, Any]:
        assignments = ", ".join(f"{key} = ?" for key in changes)
        with self._connect() as conn:
            cursor = conn.execute(
                f"UPDATE orders SET {assignments}, version = version + 1 "
                "WHERE id = ? AND version = ?",
                (*changes.values(), order_id, expected_version),
            )
            if cursor.rowcount == 0:
                current = conn.execute(
                    "SELECT version FROM orders WHERE id = ?", (order_id,)
                ).fetchone()
                raise ConflictError(f"order:{order_id}", expected_version, current and current[0])
        return self.get(order_id)


@dataclass
class RaceGate:
    """Stages the race: both agents read version 1, then the cancellation writes first."""

    both_read: threading.Barrier = field(default_factory=lambda: threading.Barrier(2))
    cancelled: threading.Event = field(default_factory=threading.Event)


def shop_tools(shop: Shop, gate: RaceGate | None = None) -> list[Tool]:
    first_read = threading.Event()

    @tool
    def lookup_order(order_id: str) -> str:
        """Look an order up: status, shipping address and version.

        Args:
            order_id: The order number.
        """
        order = shop.get(order_id)
        if gate is not None and not first_read.is_set():
            first_read.set()
            gate.both_read.wait(timeout=10)  # both have read version 1 before either writes
        return json.dumps(order)

    @tool(side_effect=True, idempotent=False)
    def cancel_order(order_id: str, version: int) -> str:
        """Cancel an order that has not shipped.

        Args:
            order_id: The order number.
            version: The order version you read with lookup_order.
        """
        try:
            return json.dumps(shop.update(order_id, version, status="cancelled"))
        finally:
            if gate is not None:
                gate.cancelled.set()

    @tool(side_effect=True, idempotent=False)
    def change_address(order_id: str, address: str, version: int) -> str:
        """Change the shipping address of an order that is still to be shipped.

        Args:
            order_id: The order number.
            address: The new address.
            version: The order version you read with lookup_order.
        """
        if gate is not None:
            # Make the race's outcome repeatable: the cancellation writes first.
            gate.cancelled.wait(timeout=10)
        return json.dumps(shop.update(order_id, version, address=address))

    return [lookup_order, cancel_order, change_address]


def support_policy(call: ScriptedCall) -> Message | str:
    """A scripted support model: look up, act on the version read, re-read on a conflict."""
    user = call.last_user_text
    since = call.messages[max(i for i, m in enumerate(call.messages) if m.role == "user") + 1 :]
    results = [m.content for m in since if m.role == "tool"]
    found = re.search(r"\b(\d{4})\b", user)
    order_id = found.group(1) if found else "1024"
    last = results[-1] if results else ""
    if not results or "conflict" in last.lower():
        # First look, or our write lost the race: read the order again before deciding.
        return ScriptedModel.tool_call("lookup_order", json.dumps({"order_id": order_id}))
    order = json.loads(last) if last.startswith("{") else None
    if order is None:
        return f"Sorry, something went wrong with order {order_id}: {last}"
    written = len(results) > 1 and not any("conflict" in r.lower() for r in results[-1:])
    wants_cancel = "cancel" in user.lower()
    if wants_cancel:
        if order["status"] == "cancelled":
            return f"Order {order_id} is cancelled."
        arguments = {"order_id": order_id, "version": order["version"]}
        return ScriptedModel.tool_call("cancel_order", json.dumps(arguments))
    if order["status"] == "cancelled":
        return f"Order {order_id} has been cancelled, so its address can't be changed."
    if written and order["address"] == "9 New Street":
        return f"The shipping address of order {order_id} is now 9 New Street."
    arguments = {"order_id": order_id, "address": "9 New Street", "version": order["version"]}
    return ScriptedModel.tool_call("change_address", json.dumps(arguments))


def agent_for(database: SQLiteDatabase, shop: Shop, gate: RaceGate | None) -> Agent:
    return Agent(
        ScriptedModel(support_policy),
        state=StateStore(SQLStateBackend(database), AgentState),
        system_prompt="You are the support agent of an online shop.",
        tools=shop_tools(shop, gate),
        journal=SQLToolJournal(database),
    )


async def race(workdir: Path) -> tuple[str, str, dict[str, Any]]:
    shop = Shop(workdir / "shop.db")
    gate = RaceGate()
    first = agent_for(SQLiteDatabase(workdir / "keel.db"), shop, gate)
    second = agent_for(SQLiteDatabase(workdir / "keel.db"), shop, gate)
    cancel, change = await asyncio.gather(
        first.handle("customer-1", "ada", "Please cancel order 1024."),
        second.handle("customer-1-phone", "ada", "Change the shipping address of 1024 first!"),
    )
    return cancel.text, change.text, shop.get("1024")


SUPPORT_PROMPT = (
    "You are the customer-support agent of an online shop. Find the customer's order with "
    "lookup_order (by their e-mail address or the order number) before acting on it. Refund "
    "only the order's total or less, with issue_refund; an operator approves every refund."
)


def support_tools(shop: Shop) -> list[Tool]:
    """The support agent's tools: look orders up, and refund one (after approval)."""

    @tool
    def lookup_order(email_or_order_id: str) -> str:
        """Find orders by the customer's e-mail address or by order number.

        Args:
            email_or_order_id: The customer's e-mail address, or an order number like 1024.
        """
        found = shop.find(email_or_order_id)
        return json.dumps(found) if found else f"no order for {email_or_order_id}"

    @tool(
        side_effect=True,
        idempotent=False,
        approval="operator",
        waiting_message=(
            "I've asked a colleague to approve the refund; I'll let you know as soon as it's done."
        ),
    )
    def issue_refund(order_id: str, amount: float, reason: str = "") -> str:
        """Refund (part of) an order to the customer's card.

        Args:
            order_id: The order number.
            amount: How much to refund, at most the order's total.
            reason: Why, in a few words.
        """
        orders = shop.find(order_id)
        if not orders:
            return f"no order {order_id}: nothing refunded"
        if amount <= 0 or amount > orders[0]["total"]:
            return f"cannot refund {amount}: order {order_id} totals {orders[0]['total']}"
        shop.refund(order_id, amount, reason)
        return f"refunded {amount:.2f} on order {order_id}"

    return [lookup_order, issue_refund]


def build(settings: Settings | None = None) -> Agent:
    """The customer-support agent, on the settings' database and model (default: the
    environment's, :func:`~keel.settings.load_settings`); the shop's orders and refunds live
    in ``shop.db`` in the settings' data directory.

    ``keel serve --agent examples.ecommerce_support:build`` calls it once per tenant."""
    settings = settings or load_settings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    shop = Shop(settings.data_dir / "shop.db")
    return Agent.open(settings, system_prompt=SUPPORT_PROMPT, tools=support_tools(shop))


if __name__ == "__main__":
    cancel_reply, change_reply, order = asyncio.run(race(Path(tempfile.mkdtemp())))
    print(f"agent A: {cancel_reply}\nagent B: {change_reply}\norder  : {order}")
