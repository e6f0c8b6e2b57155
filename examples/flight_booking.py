"""A flight-booking agent on the embedded default, built with keel's public API only.

Run it: ``.venv/bin/python examples/flight_booking.py``. A customer asks for two trips; the agent
searches, books each once (the booking tool is journalled: exactly once, even across a crash),
and streams its replies. The airline is the tools' dependency, handed to each turn with
``deps=`` and read from ``ToolContext`` (no closures). The model is a scripted policy
(deterministic, offline); ``--model local:smollm2`` lets the bundled local model try, and
``--model openai-compatible:...`` points it at a real one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from keel import Agent, Message, TextDelta, ToolContext, TurnFinished, tool
from keel.testing import ScriptedCall, ScriptedModel


@dataclass
class Airline:
    """The system the agent acts on: a timetable and the bookings made."""

    timetable: dict[tuple[str, str], str] = field(
        default_factory=lambda: {("Oslo", "Lima"): "SK123", ("Lima", "Pune"): "LA456"}
    )
    bookings: list[tuple[str, int, str]] = field(default_factory=list)

    def book(self, flight: str, passengers: int, key: str) -> str:
        self.bookings.append((flight, passengers, key))
        return f"PNR{len(self.bookings):04d}"


@tool
def search_flights(origin: str, destination: str, context: ToolContext[Airline]) -> str:
    """Find the flight between two cities.

    Args:
        origin: Where from.
        destination: Where to.
    """
    flight = context.deps.timetable.get((origin, destination))
    return json.dumps({"flight": flight} if flight else {"error": "no flight on that route"})


@tool(side_effect=True, idempotent=False)
def book_flight(flight: str, passengers: int, context: ToolContext[Airline]) -> str:
    """Book seats on a flight.

    Args:
        flight: The flight code from search_flights.
        passengers: How many seats.
    """
    # The idempotency key lets the airline itself refuse a second booking of the same call.
    return context.deps.book(flight, passengers, context.idempotency_key)


_REQUEST = re.compile(r"(\d+) seats? from (\w+) to (\w+)")


def scripted_agent_model(call: ScriptedCall) -> Message | str:
    """The deterministic stand-in for a model: search, book, then confirm."""
    last = call.messages[-1]
    wanted = _REQUEST.search(call.last_user_text)
    if wanted is None:
        return "Tell me how many seats, and from where to where."
    seats, origin, destination = wanted.groups()
    if last.role == "user":
        arguments = {"origin": origin, "destination": destination}
        return ScriptedModel.tool_call("search_flights", json.dumps(arguments))
    if last.name == "search_flights":
        found = json.loads(last.content)
        if "flight" not in found:
            return f"There is no flight from {origin} to {destination}."
        arguments = {"flight": found["flight"], "passengers": int(seats)}
        return ScriptedModel.tool_call("book_flight", json.dumps(arguments))
    return f"Booked {seats} seats from {origin} to {destination}: reference {last.content}."


async def main(model_spec: str, trips: int, workdir: Path) -> dict[str, int]:
    airline = Airline()
    model = ScriptedModel(scripted_agent_model) if model_spec == "scripted" else model_spec
    requests = ["Book 2 seats from Oslo to Lima, please.", "Now 1 seat from Lima to Pune."]
    async with Agent.open(
        f"sqlite:///{workdir / 'keel.db'}",
        model=model,
        system_prompt="You are SkyDesk, a flight-booking assistant. Use the tools.",
        tools=[search_flights, book_flight],
        memory=False,
    ) as agent:
        for text in requests[:trips]:
            print(f"customer: {text}\nagent   : ", end="", flush=True)
            async for event in agent.stream(text, session="example", user="ada", deps=airline):
                if isinstance(event, TextDelta):
                    print(event.text, end="", flush=True)
                elif isinstance(event, TurnFinished):
                    print(f"  [{event.reply.status}]")
    return dict(Counter(flight for flight, _, _ in airline.bookings))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="scripted")
    parser.add_argument("--trips", type=int, default=2)
    args = parser.parse_args()
    bookings = asyncio.run(main(args.model, args.trips, Path(tempfile.mkdtemp())))
    print(f"airline bookings per flight: {bookings}")
