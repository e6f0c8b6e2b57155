"""The seeds' flight-booking agent, offline, on the embedded default.

Run it: ``.venv/bin/python examples/flight_booking.py``. It books two trips with a customer who
asks side questions and changes dates, then prints the conversation and what the airline holds.
The model is keel's scripted policy (deterministic, no network); pass ``--model local:smollm2``
to watch the bundled local model try (a 135M model gets lost quickly; the guards keep it bounded).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

from keel.context import ContextBudget
from keel.demo import Airline, FlightUser, demo_machine, flight_tools, plans, policy_model
from keel.models import resolve_model
from keel.runtime import Agent
from keel.state import AgentState, StateStore
from keel.stores import SQLiteDatabase, SQLiteStateBackend, SQLiteToolJournal
from keel.testing import ScriptedModel


async def main(model_spec: str, trips: int, workdir: Path) -> dict[str, int]:
    database = SQLiteDatabase(workdir / "keel.db")
    airline = Airline(workdir / "airline.db")
    model = ScriptedModel(policy_model) if model_spec == "scripted" else resolve_model(model_spec)
    agent = Agent(
        model,
        state=StateStore(SQLiteStateBackend(database), AgentState),
        system_prompt="You are SkyDesk, a flight-booking assistant. Use the tools.",
        tools=flight_tools(airline),
        machine=demo_machine(),
        journal=SQLiteToolJournal(database),
        context=ContextBudget(working_budget=8_000),
    )
    customer = FlightUser(plans(trips, side_questions=2))
    reply = ""
    for _ in range(60 * trips):
        message = customer.next_message(reply)
        if message is None:
            break
        result = await agent.handle("example-session", "ada", message)
        reply = result.text
        print(f"customer: {message}\nagent   : {reply[:110]}  [{result.workflow_state}]")
    database.close()
    return airline.bookings_per_trip()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="scripted")
    parser.add_argument("--trips", type=int, default=2)
    args = parser.parse_args()
    bookings = asyncio.run(main(args.model, args.trips, Path(tempfile.mkdtemp())))
    print(f"airline bookings per trip: {bookings}")
