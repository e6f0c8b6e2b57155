"""The seeds' flight-booking agent: an airline, its tools, a workflow, a user and a policy.

Everything here is deterministic and offline. The airline is a separate SQLite file (an
external system: it does not deduplicate bookings, so exactly-once must come from keel's
journal). `policy_model` is a scripted stand-in for an LLM: it reads only what a real
model would see (the compiled prompt: the workflow's resume instructions, the conversation,
tool results) and answers with structured tool calls.
"""

from __future__ import annotations

import hashlib
import json
import re
import sqlite3
import threading
import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field

from keel.messages import Message, ToolCall
from keel.state import MachineState, StateMachine, Transition
from keel.testing import ScriptedCall
from keel.tools import Tool, ToolContext, tool

__all__ = [
    "BOOKED_REPLY",
    "Airline",
    "FlightUser",
    "TripPlan",
    "demo_machine",
    "flight_tools",
    "plans",
    "policy_model",
    "question_slot",
]

SYSTEM_PROMPT = (
    "You are SkyDesk, a flight-booking assistant. Be accurate and brief. Never invent flights, "
    "prices or booking references: use the tools. Never reveal other customers' data."
)
RULES = (
    "Ask for one missing detail at a time. Confirm the itinerary before booking.",
    "Answer policy questions with get_travel_policy.",
)

_SLOT_STATES = (
    ("gathering_origin", "origin", "Where will you be flying from?"),
    ("gathering_destination", "destination", "Where would you like to fly to?"),
    ("gathering_dates", "dates", "Which dates would you like to travel?"),
    ("gathering_passengers", "passengers", "How many passengers are travelling?"),
)
_NEXT_STATE = {
    "gathering_origin": "gathering_destination",
    "gathering_destination": "gathering_dates",
    "gathering_dates": "gathering_passengers",
    "gathering_passengers": "confirming",
}
_QUESTIONS = {slot: question for _, slot, question in _SLOT_STATES}


def demo_machine() -> StateMachine:
    """The seed's flight-booking workflow with the demo's tools in each step."""
    everywhere = ("get_travel_policy",)
    states = [
        MachineState(
            "idle",
            "no booking in progress",
            "Offer to book a flight.",
            everywhere,
            max_retries=None,
        ),
        *[
            MachineState(name, f"asking for {slot}", question, everywhere, collects=(slot,))
            for name, slot, question in _SLOT_STATES
        ],
        MachineState(
            "confirming",
            "confirming the itinerary",
            "Search flights, read the best one back and ask the user to confirm or change dates.",
            ("search_flights", *everywhere),
        ),
        MachineState(
            "booking",
            "booking the confirmed flight",
            "Book the flight, record the booking reference, send the itinerary.",
            ("book_flight", "send_itinerary", *everywhere),
        ),
        MachineState(
            "completed",
            "the flight is booked",
            "Give the booking reference.",
            terminal=True,
            max_retries=None,
        ),
        MachineState(
            "failed",
            "booking failed",
            "Apologise and offer to try again.",
            everywhere,
            max_retries=None,
        ),
    ]
    transitions = [
        Transition("idle", "gathering_origin"),
        Transition("gathering_origin", "gathering_destination", requires=("origin",)),
        Transition("gathering_destination", "gathering_dates", requires=("destination",)),
        Transition("gathering_dates", "gathering_passengers", requires=("dates",)),
        Transition("gathering_passengers", "confirming", requires=("passengers",)),
        Transition("confirming", "gathering_dates", description="the user changes the dates"),
        Transition(
            "confirming", "booking", requires=("origin", "destination", "dates", "passengers")
        ),
        Transition("booking", "completed", requires=("booking_reference",)),
        Transition("failed", "idle"),
        Transition(
            "failed", "confirming", requires=("origin", "destination", "dates", "passengers")
        ),
    ]
    return StateMachine(
        "flight_booking", states=states, transitions=transitions, initial="idle", failure="failed"
    )


# --- the airline (an external system) ------------------------------------------------------


class Airline:
    """A toy airline backed by its own SQLite file. It books whatever it is asked to book.

    Its records are the ground truth the demo is judged by: every flight it listed (route and
    day), every booking with the trip it is for (customer, route, day of the flight booked)
    and the caller's request key, so an operator can check an in-doubt booking with it.
    """

    def __init__(self, path: Path | str) -> None:
        self.path = str(path)
        self._local = threading.local()
        conn = self._conn()
        conn.execute(
            "CREATE TABLE IF NOT EXISTS flights (code TEXT PRIMARY KEY, origin TEXT, "
            "destination TEXT, day TEXT)"
        )
        conn.execute(
            "CREATE TABLE IF NOT EXISTS bookings (reference TEXT PRIMARY KEY, flight TEXT, "
            "passengers INTEGER, trip TEXT, request_key TEXT, booked_at REAL)"
        )
        conn.execute("CREATE TABLE IF NOT EXISTS itineraries (reference TEXT, sent_at REAL)")

    def _conn(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(self.path, isolation_level=None, timeout=10)
            conn.execute("PRAGMA journal_mode = WAL")
            self._local.conn = conn
        return conn

    def search(self, origin: str, destination: str, dates: str) -> str:
        """A long, deterministic flight listing (thousands of tokens), best option first."""
        seed = int(hashlib.sha256(f"{origin}|{destination}|{dates}".encode()).hexdigest(), 16)
        lines = []
        listed = []
        day = dates.split(" ")[0]
        for index in range(60):
            number = 100 + (seed >> (index % 40)) % 800
            price = 120 + (seed >> (index % 30)) % 900 + index * 7
            code = f"SK{number}{index:02d}"
            lines.append(
                f"{code}: {origin} -> {destination} on {dates.split(' ')[0]}, departs "
                f"{6 + index % 16:02d}:{(index * 7) % 60:02d}, {1 + index % 3} stop(s), "
                f"fare {price} EUR, economy, 23 kg bag included, seat selection from 12 EUR, "
                f"aircraft A32{index % 10}, on-time performance {70 + index % 29}%"
            )
            listed.append((code, origin, destination, day))
        self._conn().executemany(
            "INSERT INTO flights VALUES (?, ?, ?, ?) ON CONFLICT (code) DO NOTHING", listed
        )
        return f"BEST: {lines[0].split(':')[0]}\n" + "\n".join(lines)

    def book(
        self, flight: str, passengers: int, *, customer: str, request_key: str | None = None
    ) -> str:
        """Book ``flight``; the trip is the customer's journey on that flight's route and day."""
        row = (
            self._conn()
            .execute("SELECT origin, destination, day FROM flights WHERE code = ?", (flight,))
            .fetchone()
        )
        route = f"{row[0]}->{row[1]} on {row[2]}" if row is not None else f"flight {flight}"
        trip = f"{customer}: {route}"
        # Derived from the airline's own count, not the clock: the same demo sends the same
        # prompts (and token counts) every run, and a second booking still gets its own.
        (booked,) = self._conn().execute("SELECT count(*) FROM bookings").fetchone()
        reference = (
            "PNR" + hashlib.sha256(f"{flight}|{trip}|{booked}".encode()).hexdigest()[:6].upper()
        )
        self._conn().execute(
            "INSERT INTO bookings VALUES (?, ?, ?, ?, ?, ?)",
            (reference, flight, passengers, trip, request_key, time.time()),
        )
        return reference

    def booking_for_request(self, request_key: str) -> str | None:
        """The reference of the booking made for ``request_key``, if the airline made one."""
        row = (
            self._conn()
            .execute(
                "SELECT reference FROM bookings WHERE request_key = ? ORDER BY booked_at LIMIT 1",
                (request_key,),
            )
            .fetchone()
        )
        return None if row is None else str(row[0])

    def send_itinerary(self, reference: str) -> None:
        self._conn().execute("INSERT INTO itineraries VALUES (?, ?)", (reference, time.time()))

    def bookings_per_trip(self) -> dict[str, int]:
        """How many bookings the airline holds for each trip (customer, route, day)."""
        rows = self._conn().execute("SELECT trip, count(*) FROM bookings GROUP BY trip")
        return {str(trip): int(count) for trip, count in rows}


_POLICIES = {
    "baggage": "One 23 kg checked bag and one 8 kg cabin bag are included on every fare. ",
    "pets": "Small pets under 8 kg may travel in the cabin in an approved carrier. ",
    "meals": "Hot meals are served on flights over three hours; special meals on request. ",
    "wifi": "Wi-Fi is available on all A321 aircraft; messaging is free. ",
    "seats": "Seat selection opens at booking and is free at check-in. ",
    "refunds": "Flexible fares are refundable until 24 hours before departure. ",
}


def flight_tools(
    airline: Airline, *, stall_file: Path | None = None, stalled_file: Path | None = None
) -> list[Tool]:
    """The demo's tools bound to ``airline``. ``stall_file``: when it exists, the next
    ``book_flight`` books, then removes it, writes ``stalled_file`` and hangs before returning
    (the demo kills it there: booked at the airline, no result in the journal or state)."""

    @tool
    def get_travel_policy(
        topic: Annotated[str, Field(description="baggage, pets, meals, wifi, seats or refunds")],
    ) -> str:
        """Look up the airline's policy on a topic."""
        text = _POLICIES.get(topic.strip().lower())
        if text is None:
            raise LookupError(f"no policy on {topic!r}; topics: {', '.join(_POLICIES)}")
        return (text * 40).strip()

    @tool
    def search_flights(origin: str, destination: str, dates: str) -> str:
        """Search flights for the itinerary.

        Args:
            origin: Departure city.
            destination: Arrival city.
            dates: Travel dates as the user gave them.
        """
        return airline.search(origin, destination, dates)

    @tool(side_effect=True, idempotent=False, timeout_s=30)
    def book_flight(flight: str, passengers: int, context: ToolContext) -> str:
        """Book seats on a flight (charges the customer).

        Args:
            flight: The flight code from search_flights, e.g. "SK12300".
            passengers: Number of seats.
        """
        reference = airline.book(
            flight, passengers, customer=context.session_id, request_key=context.idempotency_key
        )
        if stall_file is not None and stall_file.exists():
            stall_file.unlink()
            if stalled_file is not None:
                stalled_file.write_text("stalled in book_flight, after the airline booked")
            time.sleep(120)  # the demo's parent kills the process here
        return reference

    @tool(side_effect=True, idempotent=True, timeout_s=120)
    def send_itinerary(reference: str) -> str:
        """E-mail the itinerary for a booking reference to the customer.

        Args:
            reference: The booking reference from book_flight.
        """
        airline.send_itinerary(reference)
        return f"itinerary for {reference} sent"

    return [get_travel_policy, search_flights, book_flight, send_itinerary]


# --- the simulated user -------------------------------------------------------------------


@dataclass
class TripPlan:
    """One trip the simulated user books."""

    origin: str
    destination: str
    dates: str
    passengers: int
    new_dates: str | None = None
    fillers: tuple[str, ...] = ()


_CITIES = (
    "Lisbon",
    "Tokyo",
    "Nairobi",
    "Lima",
    "Oslo",
    "Hanoi",
    "Montreal",
    "Cairo",
    "Perth",
    "Bogota",
    "Seoul",
    "Dublin",
)
_FILLERS = (
    "What's the baggage allowance?",
    "Can I bring my cat?",
    "Are meals included?",
    "Is there wifi on board?",
    "Can I choose my seat?",
    "What about refunds?",
    "Can I bring a surfboard?",  # no policy: the tool fails and a naive model retries
)
_FILLER_TOPICS = {
    "baggage": "baggage",
    "cat": "pets",
    "meals": "meals",
    "wifi": "wifi",
    "seat": "seats",
    "refunds": "refunds",
    "surfboard": "surfboards",
}


BOOKED_REPLY = "Your booking reference is"
"""What a reply says when a trip is booked: the customer moves on to the next trip."""


def plans(trips: int, side_questions: int) -> list[TripPlan]:
    """Deterministic trips, each a different journey; every other one changes its dates at
    confirmation."""
    result = []
    for index in range(trips):
        origin = _CITIES[index % len(_CITIES)]
        destination = _CITIES[(index * 5 + 3) % len(_CITIES)]
        day = 1 + (index * 3) % 27
        # Route and day repeat every 36 trips (12 cities, 9 days): later rounds fly in later
        # months, so no two trips are the same journey (the airline counts bookings per trip).
        rounds = index // 36
        year, month = 2027 + rounds // 6, 1 + 2 * (rounds % 6)
        first = f"{year}-{month:02d}"
        dates = f"{first}-{day:02d} to {first}-{day + 1:02d}"
        later = f"{year}-{month + 1:02d}"
        new = f"{later}-{day:02d} to {later}-{day + 2:02d}" if index % 2 == 1 else None
        fill = tuple(_FILLERS[(index + k) % len(_FILLERS)] for k in range(side_questions))
        result.append(TripPlan(origin, destination, dates, 1 + index % 4, new, fill))
    return result


def question_slot(reply: str) -> str | None:
    """Which detail an assistant reply asks for (None: it asks for none)."""
    for slot, question in _QUESTIONS.items():
        if question in reply:
            return slot
    return None


@dataclass
class FlightUser:
    """A customer who books trip after trip, asks side questions and changes dates.

    Deterministic: what it says depends only on its plans and the assistant's last reply.
    """

    trips: list[TripPlan]
    trip_index: int = 0
    said_dates_change: bool = False
    fillers_left: list[str] = field(default_factory=list)
    started: bool = False
    finished: bool = False
    said: int = 0

    @property
    def trip(self) -> TripPlan:
        """The trip being booked now."""
        return self.trips[self.trip_index]

    def next_message(self, last_reply: str) -> str | None:
        """What the user says next, given the assistant's last reply (None: all booked)."""
        if self.finished or not self.trips:
            return None
        self.said += 1
        if BOOKED_REPLY in last_reply:
            self.trip_index += 1
            self.said_dates_change = False
            self.started = False
            if self.trip_index >= len(self.trips):
                self.finished = True
                return None
        trip = self.trip
        if not self.started:
            self.started = True
            self.fillers_left = list(trip.fillers)
            return "Hi! I'd like to book a flight."
        # Every other message is a side question while some are left.
        if self.fillers_left and self.said % 2 == 0:
            return self.fillers_left.pop(0)
        slot = question_slot(last_reply)
        answers = {
            "origin": f"From {trip.origin}.",
            "destination": f"To {trip.destination}.",
            "dates": f"Travelling {trip.dates}.",
            "passengers": f"{trip.passengers} passengers.",
        }
        if slot is not None:
            return answers[slot]
        if "Shall I book" in last_reply:
            if trip.new_dates and not self.said_dates_change:
                self.said_dates_change = True
                return f"Actually, change the dates to {trip.new_dates}."
            return "Yes, book it."
        return "Thanks. Where were we?"


# --- the policy: a scripted stand-in for an LLM ---------------------------------------------

_KNOWN = re.compile(r"Already known \(do not ask for these again\): (.*)\.$", re.M)
_STEP = re.compile(r"^Current step: (\w+)", re.M)


def _prompt_facts(messages: tuple[Message, ...]) -> tuple[str, dict[str, str]]:
    step, known = "idle", {}
    for message in messages:
        if message.role != "system":
            continue
        if match := _STEP.search(message.content):
            step = match.group(1)
        if match := _KNOWN.search(message.content):
            for pair in match.group(1).split("; "):
                key, _, value = pair.partition(" = ")
                known[key.strip()] = value.strip()
    return step, known


def _since_user(messages: tuple[Message, ...]) -> tuple[str, list[tuple[ToolCall, str]], bool]:
    """The newest user text, the tool calls made since with their results, and whether a guard
    told the model to change approach."""
    user_index = max((i for i, m in enumerate(messages) if m.role == "user"), default=-1)
    user = messages[user_index].content if user_index >= 0 else ""
    results = {m.tool_call_id: m.content for m in messages[user_index + 1 :] if m.role == "tool"}
    calls = [
        (call, results.get(call.id, ""))
        for m in messages[user_index + 1 :]
        if m.role == "assistant"
        for call in m.tool_calls
    ]
    warned = any(
        m.role == "system" and "change" in m.content.lower() and "approach" in m.content.lower()
        for m in messages[user_index + 1 :]
    )
    return user, calls, warned


_PROMPT: ContextVar[str] = ContextVar("keel_demo_prompt", default="")
"""A digest of the prompt the policy is answering (tool call ids are made from it)."""


def _prompt_digest(messages: tuple[Message, ...]) -> str:
    digest = hashlib.sha256()
    for message in messages:
        ids = ",".join(call.id for call in message.tool_calls)
        digest.update(f"{message.role}|{message.tool_call_id}|{ids}|{message.content}\0".encode())
    return digest.hexdigest()


def _call(name: str, **arguments: Any) -> Message:
    # The id follows from the call and the prompt that led to it (each prompt holds every
    # earlier call's id), not from the clock: ids, and so prompt token counts, are the same
    # in every run of the demo, and a new call in the conversation still gets a new id.
    prompt = _PROMPT.get()
    digest = hashlib.sha256(f"{name}{arguments}{prompt}".encode()).hexdigest()[:10]
    return Message.assistant(
        "", tool_calls=[ToolCall(id=f"call_{digest}", name=name, arguments=json.dumps(arguments))]
    )


def policy_model(call: ScriptedCall) -> Message | str:
    """Decide the next action from the prompt alone, as a tool-calling LLM would."""
    token = _PROMPT.set(_prompt_digest(call.messages))
    try:
        return _policy(call)
    finally:
        _PROMPT.reset(token)


def _policy(call: ScriptedCall) -> Message | str:
    step, known = _prompt_facts(call.messages)
    user, done, warned = _since_user(call.messages)
    names = [c.name for c, _ in done]
    text = user.lower()
    topic = next((t for word, t in _FILLER_TOPICS.items() if word in text), None)
    if topic is not None:
        if warned:
            return f"Sorry, I have no information about {topic}. " + _reprompt(step, known)
        answers = [r for c, r in done if c.name == "get_travel_policy" and "no policy" not in r]
        if answers:
            return answers[0][:160].rsplit(".", 1)[0] + ". " + _reprompt(step, known)
        # A naive model retries a failing call; keel's loop guard stops it.
        return _call("get_travel_policy", topic=topic)
    slot_value = _user_slot(user)
    if step == "idle" and "book a flight" in text:
        return _call("go_to", step="gathering_origin")
    if slot_value is not None:
        slot, value = slot_value
        if step == "confirming" and slot == "dates" and known.get("dates") != value:
            return _call("go_to", step="gathering_dates")
        if known.get(slot) != value and step != "confirming":
            return _call("remember", slot=slot, value=value)
    if step == "confirming" and text.startswith("yes") and "go_to" not in names:
        return _call("go_to", step="booking")
    for state, slot, _question in _SLOT_STATES:
        if step == state and slot in known:
            return _call("go_to", step=_NEXT_STATE[state])
    if step == "confirming":
        searches = [r for c, r in done if c.name == "search_flights"]
        if not searches:
            return _call(
                "search_flights",
                origin=known.get("origin", ""),
                destination=known.get("destination", ""),
                dates=known.get("dates", ""),
            )
        best = searches[-1].split("\n", 1)[0].removeprefix("BEST: ")
        return (
            f"The best option is {best} from {known.get('origin')} to "
            f"{known.get('destination')}, {known.get('dates')}, for {known.get('passengers')} "
            "passengers. Shall I book it?"
        )
    if step == "booking":
        booked = [r for c, r in done if c.name == "book_flight" and r.startswith("PNR")]
        if not booked:
            flight = _last_best(call.messages)
            return _call("book_flight", flight=flight, passengers=int(known.get("passengers", 1)))
        reference = booked[-1].strip()
        if known.get("booking_reference") != reference:
            return _call("remember", slot="booking_reference", value=reference)
        if "send_itinerary" not in names:
            return _call("send_itinerary", reference=reference)
        return _call("go_to", step="completed")
    if step == "completed":
        reference = known.get("booking_reference", "?")
        return f"Done! {BOOKED_REPLY} {reference}. The itinerary is in your inbox."
    return _reprompt(step, known)


def _reprompt(step: str, known: dict[str, str]) -> str:
    for state, slot, question in _SLOT_STATES:
        if step == state and slot not in known:
            return question
    if step == "confirming":
        return "Shall I book it?"
    return "Would you like to book a flight?"


def _last_best(messages: tuple[Message, ...]) -> str:
    for message in reversed(messages):
        if message.role == "tool" and message.content.startswith("BEST: "):
            return message.content.split("\n", 1)[0].removeprefix("BEST: ")
    return "SK10000"


def _user_slot(user: str) -> tuple[str, str] | None:
    if match := re.match(r"^From (.+)\.$", user):
        return "origin", match.group(1)
    if match := re.match(r"^To (.+)\.$", user):
        return "destination", match.group(1)
    if match := re.match(r"^Travelling (.+)\.$", user):
        return "dates", match.group(1)
    if match := re.match(r"^Actually, change the dates to (.+)\.$", user):
        return "dates", match.group(1)
    if match := re.match(r"^(\d+) passengers\.$", user):
        return "passengers", match.group(1)
    return None
