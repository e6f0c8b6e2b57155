"""What ``keel bench faults`` runs its agents against: the outside world and the faulty model.

* The world: a `Ledger` of the effects the bench tools really had (a SQLite file apart
  from keel's), the crash armed for the current run, and the tools themselves.
* The plans: per fault kind, the script of a run (one reply per model call) and its settings;
  `PlannedModel` plays a plan so that a resumed run continues where a crashed one
  stopped; `booking_policy` is the customer-service model of the worker processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from keel.errors import ModelUnavailableError
from keel.messages import Message, Usage
from keel.models import Completion, ModelOptions, ToolSchema
from keel.testing import ScriptedCall, ScriptedModel
from keel.tools import Tool, ToolContext, tool

__all__ = [
    "FINAL",
    "PLANS",
    "Crash",
    "Crasher",
    "Ledger",
    "PlannedModel",
    "World",
    "booking_policy",
    "plan_run",
    "worker_tools",
    "world_tools",
]

_SLOW_BOOKING_S = 0.3
FINAL = "Here is what I found for you."
_HANG = "hang"
_HANG_ONCE = "hang_once"
_CITIES = ("Paris", "Lyon", "Oslo", "Rome", "Lima", "Kyiv", "Doha", "Baku", "Riga", "Bern", "Nice")


class Crash(BaseException):
    """Simulates the process dying: not an Exception, so nothing in keel catches it."""


# --- the outside world: a ledger of effects keel does not own --------------------------------


class Ledger:
    """The external systems' own records: one row per effect that really happened.

    A SQLite file apart from keel's, written by the tools themselves (from any process), keyed
    by the business key the customer asked for (an order number), never by keel's keys.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        with self._connect() as conn:
            conn.execute(
                "CREATE TABLE IF NOT EXISTS effects (session TEXT, tool TEXT, business_key TEXT, "
                "idempotent INTEGER, idempotency_key TEXT, pid INTEGER, at REAL)"
            )

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        conn.execute("PRAGMA journal_mode = WAL")
        return conn

    def record(
        self, context: ToolContext | None, tool_name: str, business_key: str, *, idempotent: bool
    ) -> None:
        with contextlib.closing(self._connect()) as conn:
            conn.execute(
                "INSERT INTO effects VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    context.session_id if context else "",
                    tool_name,
                    business_key,
                    int(idempotent),
                    context.idempotency_key if context else "",
                    os.getpid(),
                    time.time(),
                ),
            )

    def counts(
        self, session: str | None = None, *, idempotent: bool = False
    ) -> dict[tuple[str, str], int]:
        """Effects per (session, business key)."""
        where = "WHERE idempotent = ?" + (" AND session = ?" if session is not None else "")
        params: tuple[Any, ...] = (int(idempotent),) + ((session,) if session else ())
        with contextlib.closing(self._connect()) as conn:
            rows = conn.execute(
                f"SELECT session, business_key, COUNT(*) FROM effects {where} "
                "GROUP BY session, business_key",
                params,
            ).fetchall()
        return {(str(s), str(k)): int(n) for s, k, n in rows}


@dataclass
class Crasher:
    """Arms one simulated crash: where, and whether it already happened."""

    where: str = ""
    fired: bool = False

    def maybe(self, where: str) -> None:
        if self.where == where and not self.fired:
            self.fired = True
            raise Crash(where)


@dataclass
class World:
    """What the bench tools act on: the ledger, the crash armed for the current run, and the
    slow bookings still running in abandoned threads (waited for before the database closes)."""

    ledger: Ledger
    crasher: Crasher = field(default_factory=Crasher)
    slow_booking: bool = False
    slow_running: list[threading.Event] = field(default_factory=list)

    def after_booking(self) -> None:
        """What happens once the airline has the booking: the armed crash, or a late answer."""
        self.crasher.maybe("book_flight")
        if self.slow_booking:
            # The airline booked at once but answers after keel's tool timeout.
            done = threading.Event()
            self.slow_running.append(done)
            time.sleep(_SLOW_BOOKING_S)
            done.set()


# --- the tools -------------------------------------------------------------------------------


def _booking_tool(
    ledger: Ledger, after_booking: Callable[[], None], *, timeout_s: float | None = None
) -> Tool:
    """``book_flight``: records the booking in ``ledger`` (the effect), then ``after_booking``."""

    @tool(side_effect=True, idempotent=False, timeout_s=timeout_s)
    def book_flight(
        flight: str, passengers: int, order: str = "", ctx: ToolContext | None = None
    ) -> str:
        """Book seats on a flight (charges the card).

        Args:
            flight: Flight number.
            passengers: Number of seats.
            order: The customer's order number.
        """
        business_key = order or f"{flight}x{passengers}"
        ledger.record(ctx, "book_flight", business_key, idempotent=False)
        after_booking()
        return f"booked {passengers} seat(s) on {flight}, order {business_key}"

    return book_flight


def _lookup_tools() -> dict[str, Tool]:
    """The tools without side effects, by name (one that raises, one that hangs, one that
    answers too much)."""

    @tool
    def search_flights(origin: str, destination: str, date: str = "2026-12-01") -> str:
        """Find flights between two cities.

        Args:
            origin: City the trip starts from.
            destination: City the trip goes to.
            date: Day of travel, YYYY-MM-DD.
        """
        return json.dumps([{"flight": f"KL{len(origin) * 100 + len(destination)}", "date": date}])

    @tool
    def get_weather(city: str) -> str:
        """Current weather in a city.

        Args:
            city: The city.
        """
        return f"{city}: {len(city) * 3} C, clear"

    @tool
    def flaky_lookup(code: int) -> str:
        """Look up a booking code.

        Args:
            code: The numeric code.
        """
        raise ValueError(f"booking service unavailable for code {code}")

    @tool
    async def slow_report(seconds: float) -> str:
        """Build a report (slow).

        Args:
            seconds: How long the report takes.
        """
        await asyncio.sleep(seconds)
        return "report"

    @tool
    def export_history(lines: int) -> str:
        """Export the booking history.

        Args:
            lines: Number of lines.
        """
        return "\n".join(f"line {i}: booking record with some padding text" for i in range(lines))

    found = (search_flights, get_weather, flaky_lookup, slow_report, export_history)
    return {found_tool.name: found_tool for found_tool in found}


def world_tools(world: World) -> list[Tool]:
    """The in-process runs' tools: two that book or hold (their effects in ``world.ledger``),
    and the lookups."""

    @tool(side_effect=True, idempotent=True)
    def hold_seat(flight: str, seat: str, ctx: ToolContext | None = None) -> str:
        """Hold a seat (holding twice is harmless).

        Args:
            flight: Flight number.
            seat: Seat, e.g. 12A.
        """
        world.ledger.record(ctx, "hold_seat", f"{flight}/{seat}", idempotent=True)
        world.crasher.maybe("hold_seat")
        return f"seat {seat} held on {flight}"

    lookups = _lookup_tools()
    return [
        lookups["search_flights"],
        lookups["get_weather"],
        _booking_tool(world.ledger, world.after_booking),
        hold_seat,
        lookups["flaky_lookup"],
        lookups["slow_report"],
        lookups["export_history"],
    ]


def worker_tools(folder: Path, marker: Path | None) -> list[Tool]:
    """The booking tool for worker processes; ``marker``: book, write it and hang."""

    def after_booking() -> None:
        if marker is not None:
            marker.write_text("inside book_flight, after the booking")
            time.sleep(120)  # the parent kills the process here

    return [_booking_tool(Ledger(folder / "ledger.db"), after_booking, timeout_s=300)]


# --- the plans: what the faulty model says, reply by reply ----------------------------------


def _call(name: str, arguments: Any) -> Message:
    raw = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return ScriptedModel.tool_call(name, raw)


def _book(order: str, flight: str = "KL7", passengers: int = 1) -> Message:
    return _call("book_flight", {"flight": flight, "passengers": passengers, "order": order})


def _valid(rng: random.Random) -> Message:
    if rng.random() < 0.5:
        return _call("get_weather", {"city": rng.choice(_CITIES)})
    origin, destination = rng.sample(_CITIES, 2)
    return _call("search_flights", {"origin": origin, "destination": destination})


def _truncated(kind: str) -> Completion:
    texts = {
        "length": "The flights I found are",
        "fence": "Here is the code:\n```python\nprint(",
        "json": '{"answer": "KL123", "seats": ',
        "dangling": "The cheapest flight leaves at noon and",
        "empty": "",
    }
    return Completion(
        message=Message.assistant(texts[kind]),
        finish_reason="length" if kind == "length" else "stop",
        usage=Usage(prompt_tokens=50, completion_tokens=10),
        model="scripted",
        latency_ms=1.0,
    )


_REPAIRABLE = (
    '```json\n{"flight": "KL7", "passengers": 2, "order": "ORDER"}\n```',
    "{'flight': 'KL7', 'passengers': 2, 'order': 'ORDER'}",
    '{"flight": "KL7", "passengers": 2, "order": "ORDER",}',
    '{"flight": "KL7", "passengers": "2", "order": "ORDER"}',
    'Sure! {"flight": "KL7", "passengers": 2, "order": "ORDER"}',
    "{'flight': 'KL7', 'passengers': 2, 'order': 'ORDER', }",
)
_INVALID = (
    '{"flight": "KL7", "passengers": "two"}',
    '{"flight": "KL7"}',
    '{"flight": "KL7", "passengers": 2, "seat_class": "gold"}',
    '{"flight": "KL7", "passengers": 2.5}',
    '{"flight": "KL7", "passengers":',
    "[1, 2]",
)

Plan = tuple[list[Any], dict[str, Any]]
"""A run's script (one reply per model call) and its settings (``slow_booking``,
``more_turns``, ``delay_s``, ``slow``, ``crash``)."""


def _clean(rng: random.Random, order: str, lead: list[Any]) -> Plan:
    return [*lead, _book(order), FINAL], {}


def _hallucinated_tool(rng: random.Random, order: str, lead: list[Any]) -> Plan:
    wrong = [
        _call(rng.choice(["serch_flights", "book_flite", "weather", "bookFlight"]), "{}")
        for _ in range(rng.choice([1, 1, 2, 4]))
    ]
    return [*lead, *wrong, _call("get_weather", {"city": "Oslo"}), FINAL], {}


def _invalid_arguments(rng: random.Random, order: str, lead: list[Any]) -> Plan:
    bad = [_call("book_flight", rng.choice(_INVALID)) for _ in range(rng.choice([1, 1, 2, 4]))]
    return [*lead, *bad, _book(order, passengers=2), FINAL], {}


def _repairable_arguments(rng: random.Random, order: str, lead: list[Any]) -> Plan:
    repairable = _call("book_flight", rng.choice(_REPAIRABLE).replace("ORDER", order))
    return [*lead, repairable, FINAL], {}


def _endless_loop(rng: random.Random, order: str, lead: list[Any]) -> Plan:
    return [*lead, _call("get_weather", {"city": "Paris"})], {}


def _oscillation(rng: random.Random, order: str, lead: list[Any]) -> Plan:
    a = _call("get_weather", {"city": "Paris"})
    b = _call("search_flights", {"origin": "Paris", "destination": "Rome"})
    return [*lead, *([a, b] * 10)], {}


def _model_hang(rng: random.Random, order: str, lead: list[Any]) -> Plan:
    hang = _HANG if rng.random() < 0.3 else _HANG_ONCE
    return [*lead, hang, _call("get_weather", {"city": "Rome"}), FINAL], {}


def _model_error(rng: random.Random, order: str, lead: list[Any]) -> Plan:
    persistent = rng.random() < 0.3
    error = ModelUnavailableError("provider returned 503", model="scripted", attempts=3)
    return [*lead, error, error if persistent else FINAL, FINAL], {}


def _truncated_reply(rng: random.Random, order: str, lead: list[Any]) -> Plan:
    kind = rng.choice(["length", "fence", "json", "dangling", "empty"])
    again = rng.random() < 0.3
    return [*lead, _truncated(kind), _truncated(kind) if again else FINAL, FINAL], {}


def _tool_raises(rng: random.Random, order: str, lead: list[Any]) -> Plan:
    raising = [_call("flaky_lookup", {"code": 100 + i}) for i in range(rng.choice([1, 2, 3, 4]))]
    return [*lead, *raising, FINAL], {}


def _tool_hang(rng: random.Random, order: str, lead: list[Any]) -> Plan:
    return [*lead, _call("slow_report", {"seconds": 30}), FINAL], {}


def _booking_timeout(rng: random.Random, order: str, lead: list[Any]) -> Plan:
    # The booking outlives its timeout; the customer insists in a second turn and the
    # model books the same order again. It must take effect once.
    settings = {
        "slow_booking": True,
        "more_turns": [f"Did order {order} go through? Please book it."],
    }
    return [*lead, _book(order), _book(order), FINAL], settings


def _oversized_output(rng: random.Random, order: str, lead: list[Any]) -> Plan:
    return [*lead, _call("export_history", {"lines": rng.randint(200, 2000)}), FINAL], {}


def _weather_everywhere() -> list[Any]:
    return [_call("get_weather", {"city": f"{city} {i}"}) for i, city in enumerate(_CITIES * 3)]


def _never_finishes(rng: random.Random, order: str, lead: list[Any]) -> Plan:
    return _weather_everywhere(), {}


def _slow_run(rng: random.Random, order: str, lead: list[Any]) -> Plan:
    return _weather_everywhere(), {"delay_s": 0.03, "slow": True}


def _structured_output(rng: random.Random, order: str, lead: list[Any]) -> Plan:
    # The Agent takes no output schema: a malformed JSON answer is delivered as text.
    wrong_answer = rng.choice(
        ['{"flight": "KL7"}', '{"flight": "KL7", "seats": "many"}', "KL7, 2 seats"]
    )
    good = '{"flight": "KL7", "seats": 2}'
    return [*lead, wrong_answer, wrong_answer if rng.random() < 0.3 else good, good], {}


def _crash_resume(rng: random.Random, order: str, lead: list[Any]) -> Plan:
    where = rng.choice(["book_flight", "book_flight", "hold_seat", "next_model_call"])
    if where == "hold_seat":
        action = _call("hold_seat", {"flight": "KL7", "seat": "12A"})
    else:
        action = _book(order, passengers=2)
    return [*lead, action, FINAL], {"crash": where}


def _mixed(rng: random.Random, order: str, lead: list[Any]) -> Plan:
    fragments: list[list[Any]] = [
        [_call(rng.choice(["serch_flights", "weather"]), "{}")],
        [_call("book_flight", rng.choice(_REPAIRABLE).replace("ORDER", order))],
        [_call("book_flight", rng.choice(_INVALID)), _book(f"{order}-2", flight="KL8")],
        [_call("flaky_lookup", {"code": rng.randint(1, 99)})],
        [_call("export_history", {"lines": 300})],
        [_call("slow_report", {"seconds": 30})],
        [_truncated(rng.choice(["length", "fence", "empty"]))],
        [_valid(rng)],
    ]
    chosen = rng.sample(fragments, rng.randint(2, 3))
    return [*lead, *[reply for fragment in chosen for reply in fragment], FINAL], {}


PLANS: dict[str, Callable[[random.Random, str, list[Any]], Plan]] = {
    "clean": _clean,
    "hallucinated_tool": _hallucinated_tool,
    "invalid_arguments": _invalid_arguments,
    "repairable_arguments": _repairable_arguments,
    "endless_loop": _endless_loop,
    "oscillation": _oscillation,
    "model_hang": _model_hang,
    "model_error": _model_error,
    "truncated_reply": _truncated_reply,
    "tool_raises": _tool_raises,
    "tool_hang": _tool_hang,
    "booking_timeout": _booking_timeout,
    "oversized_output": _oversized_output,
    "never_finishes": _never_finishes,
    "slow_run": _slow_run,
    "structured_output": _structured_output,
    "crash_resume": _crash_resume,
    "mixed": _mixed,
}
"""Each in-process fault kind's plan, given the run's random source, its business key and the
valid calls it starts with."""


def plan_run(fault: str, rng: random.Random, order: str) -> Plan:
    """The script of a run (one reply per model call) and per-run settings. ``order`` is the
    run's business key: every booking the plan means to make carries it (``order-2`` for a
    second, different booking)."""
    lead: list[Any] = [_valid(rng) for _ in range(rng.randint(0, 2))]
    return PLANS[fault](rng, order, lead)


class PlannedModel(ScriptedModel):
    """A scripted model whose replies follow a plan indexed by the conversation's progress.

    The position is the number of replies the conversation already holds (assistant messages,
    plus the corrections that replaced unusable replies), so a resumed run (fresh model,
    restored messages) continues exactly where the crashed one stopped. Replies that leave no
    message (``hang_once``, exceptions) are consumed from the plan when used; ``hang`` stays.
    ``crash`` (``next_model_call``): the first call that sees a booking's result dies.
    """

    def __init__(self, plan: list[Any], *, delay_s: float = 0.0, crasher: Crasher) -> None:
        self.plan = plan
        self.crasher = crasher
        super().__init__(self._reply, delay_s=delay_s)

    def _index(self, messages: Sequence[Message]) -> int:
        replies = sum(
            1
            for m in messages
            if m.role == "assistant" or m.metadata.get("keel_correction") in ("truncated", "empty")
        )
        return min(replies, len(self.plan) - 1)

    def _reply(self, call: ScriptedCall) -> Any:
        return self.plan[self._index(call.messages)]

    async def _acomplete(
        self, messages: Sequence[Message], tools: Sequence[ToolSchema], options: ModelOptions
    ) -> Completion:
        if any(m.role == "tool" and m.content.startswith("booked ") for m in messages):
            self.crasher.maybe("next_model_call")
        position = self._index(messages)
        reply = self.plan[position]
        if isinstance(reply, BaseException) or reply == _HANG_ONCE:
            self.plan = [*self.plan[:position], *self.plan[position + 1 :]]
        if isinstance(reply, BaseException):
            raise reply
        if reply in (_HANG, _HANG_ONCE):
            await asyncio.sleep(3600)
        return await super()._acomplete(messages, tools, options)


_ORDER = re.compile(r"\border (\S+?)[.?]?$")


def booking_policy(marker: Path | None = None) -> Callable[[ScriptedCall], Message | str]:
    """A customer-service model: books the order the newest user message names, once it has
    no booking result for it since that message, then confirms. ``marker``: on the call that
    sees the booking's result, write it and hang (the worker is killed there)."""

    def policy(call: ScriptedCall) -> Message | str:
        users = [i for i, m in enumerate(call.messages) if m.role == "user"]
        user = call.messages[users[-1]].content if users else ""
        match = _ORDER.search(user)
        order = match.group(1) if match else "none"
        since = call.messages[users[-1] + 1 :] if users else call.messages
        results = [m.content for m in since if m.role == "tool"]
        if any(f"order {order}" in result for result in results):
            if marker is not None:
                marker.write_text("model call after the booking's result")
                time.sleep(120)  # the parent kills the process here
            return f"Booked order {order}."
        if results:
            return f"I could not book order {order}: {results[-1][:80]}"
        # Call ids unique across processes, as a provider's are (two workers share a session).
        arguments = json.dumps({"flight": "KL7", "passengers": 1, "order": order})
        return ScriptedModel.tool_call("book_flight", arguments, f"call_{uuid.uuid4().hex[:16]}")

    return policy
