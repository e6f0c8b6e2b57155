"""A database a user's erasure is tested on: real turns through `Agent` (memory on, a side
effecting tool call journaled, a call held for an operator's approval and approved, traces, the
PII vault) for one user id in two tenants and for a neighbour in the same tenant; then every
table of the database, found by introspection (``sqlite_master``, ``information_schema``), read
back whole and searched for what the erased user left.

The scan reads the tables the database has, not a list: a table a later change adds that
holds the user's rows fails it until the erasure covers it.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from dataclasses import dataclass
from typing import Any

from keel.messages import Message
from keel.runtime import Agent
from keel.settings import Settings
from keel.testing import ScriptedCall, ScriptedModel
from keel.tools import tool

USER = "erasable-user-k7"
"""The user erased, in ``TENANT``; the same id in ``OTHER_TENANT`` is someone else."""
TENANT = "acme"
OTHER_TENANT = "globex"
NEIGHBOUR = "neighbour-user-q3"
"""Another user of ``TENANT``."""


@dataclass(frozen=True)
class Person:
    """One user of one tenant, and what they leave: a session, PII, a word all their own."""

    tenant: str
    user: str
    session: str
    email: str
    word: str

    @property
    def needles(self) -> tuple[str, ...]:
        """What no row may hold once this person is erased (the user id is checked apart:
        the other tenant's user has the same one)."""
        return (self.session, self.email, self.word)


ERASED = Person(TENANT, USER, "sess-erased-7f3q", "zelda.q7@example.org", "quokkafjord")
SAME_ID_ELSEWHERE = Person(
    OTHER_TENANT, USER, "sess-kept-9x2w", "other.k9@example.net", "wombatvale"
)
NEIGHBOURLY = Person(TENANT, NEIGHBOUR, "sess-neighbour-4m8p", "nina.n4@example.com", "lemurbay")
PEOPLE = (ERASED, SAME_ID_ELSEWHERE, NEIGHBOURLY)


@tool(side_effect=True, idempotent=False)
def book(city: str) -> str:
    """Book a trip.

    Args:
        city: Where to.
    """
    return f"booked a trip to {city}"


@tool(approval=True)
def refund(amount: int, note: str) -> str:
    """Refund the customer.

    Args:
        amount: How much.
        note: Why.
    """
    return f"refunded {amount}: {note}"


def _policy(call: ScriptedCall) -> Message | str:
    last = call.messages[-1]
    if last.role == "tool":
        return f"Done: {last.content}"
    text = call.last_user_text
    word = text.split()[-1]
    if "refund" in text:
        return ScriptedModel.tool_call("refund", json.dumps({"amount": 5, "note": word}))
    return ScriptedModel.tool_call("book", json.dumps({"city": word}))


def populate(url: str, settings: Settings) -> None:
    """Two turns of each person through an `Agent` of their tenant: a booking (journaled),
    then a refund held for an operator's approval, approved and carried out; memory flushed."""
    asyncio.run(_populate(url, settings))


async def _populate(url: str, settings: Settings) -> None:
    for tenant in (TENANT, OTHER_TENANT):
        agent = Agent.open(
            url,
            model=ScriptedModel(_policy),
            tools=[book, refund],
            system_prompt="You book trips.",
            tenant_id=tenant,
            settings=settings,
        )
        try:
            for person in (p for p in PEOPLE if p.tenant == tenant):
                first = f"I am {person.email}, book me a trip to {person.word}"
                reply = await agent.run(first, session=person.session, user=person.user)
                assert reply.status == "completed", reply
                second = f"please refund it, {person.word}"
                parked = await agent.run(second, session=person.session, user=person.user)
                assert parked.status == "awaiting_approval", parked
                decided = await agent.decide(
                    person.session, parked.approvals[0].id, approve=True, by="ops"
                )
                assert decided.status != "failed", decided
            assert agent.memory is not None
            agent.memory.flush()
        finally:
            await agent.aclose()


def _cells(url: str) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every table of the database, by table (found by introspection)."""
    if url.startswith("sqlite:///"):
        with sqlite3.connect(url.removeprefix("sqlite:///")) as conn:
            tables = [
                name
                for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
            ]
            return {t: list(conn.execute(f'SELECT * FROM "{t}"')) for t in tables}
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        tables = [
            name
            for (name,) in conn.execute(
                "SELECT table_name FROM information_schema.tables "
                "WHERE table_schema = current_schema() AND table_type = 'BASE TABLE'"
            )
        ]
        return {t: list(conn.execute(f'SELECT * FROM "{t}"')) for t in tables}


def _text(cell: Any) -> str:
    if isinstance(cell, bytes | bytearray | memoryview):
        return bytes(cell).decode("latin-1")
    return cell if isinstance(cell, str) else json.dumps(cell, default=str, ensure_ascii=False)


@dataclass(frozen=True)
class Scan:
    """Where, table by table, a person's traces were found."""

    tables: frozenset[str]
    found: dict[str, dict[str, int]]
    """Table -> needle -> rows holding it."""

    def rows_with(self, needle: str) -> dict[str, int]:
        return {t: hits[needle] for t, hits in self.found.items() if hits.get(needle)}


def scan(url: str) -> Scan:
    """Every table searched for each person's session, email, word and tenant-bound user id.

    The user id counts in a row only beside that tenant's name (``tenant:user`` needles): the
    same id in the other tenant is another person."""
    cells = _cells(url)
    found: dict[str, dict[str, int]] = {}
    for table, rows in cells.items():
        for row in rows:
            text = " ".join(_text(cell) for cell in row)
            needles = [n for p in PEOPLE for n in p.needles if n in text]
            needles += [
                f"{p.tenant}:{p.user}" for p in PEOPLE if p.user in text and p.tenant in text
            ]
            for needle in needles:
                table_hits = found.setdefault(table, {})
                table_hits[needle] = table_hits.get(needle, 0) + 1
    return Scan(frozenset(cells), found)


def left_of(person: Person, found: Scan) -> dict[str, dict[str, int]]:
    """What of ``person`` the scan found, by needle and table."""
    left = {needle: found.rows_with(needle) for needle in person.needles}
    left[f"{person.tenant}:{person.user}"] = found.rows_with(f"{person.tenant}:{person.user}")
    return {needle: tables for needle, tables in left.items() if tables}


EXPECTED_BEFORE = {
    "keel_state_checkpoints",
    "keel_state_sessions",
    "keel_tool_journal",
    "keel_tool_decisions",
    "keel_approvals",
    "trace_runs",
    "trace_steps",
    "memory_records",
    "keel_pii_keys",
}
"""Tables the erased person is in before the erasure (so the scan can fail)."""
