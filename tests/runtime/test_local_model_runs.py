"""Real runs with the bundled SmolLM2-135M: it produces the faults on its own (prose instead
of calls, invented tools, wrong argument types, rambling) and every run still ends cleanly."""

from __future__ import annotations

from pathlib import Path

import pytest

from keel.demo import Airline, flight_tools
from keel.guards import GuardConfig
from keel.messages import Message
from keel.models import ModelOptions, resolve_model
from keel.runtime import ToolLoop
from keel.stores import SQLiteDatabase, SQLToolJournal
from keel.tools import ToolRegistry

PROMPTS = (
    "Search flights from Lisbon to Tokyo travelling 2027-01-03, then book the best one for 2.",
    "What is the baggage policy? Use get_travel_policy.",
    "Book flight SK12300 for two passengers.",
)


@pytest.mark.slow
@pytest.mark.parametrize("prompt", PROMPTS)
async def test_local_model_runs_end_within_limits(prompt: str, tmp_path: Path) -> None:
    database = SQLiteDatabase(tmp_path / "keel.db")
    airline = Airline(tmp_path / "airline.db")
    loop = ToolLoop(
        resolve_model("local:smollm2"),
        ToolRegistry(flight_tools(airline)),
        guards=GuardConfig(max_steps=4, run_timeout_s=240, model_timeout_s=90),
        journal=SQLToolJournal(database),
        options=ModelOptions(max_tokens=96, temperature=0.0, seed=7),
    )
    result = await loop.arun(
        [Message.system("You are SkyDesk, a flight-booking assistant."), Message.user(prompt)],
        session_id="local-run",
    )
    # Whatever the tiny model did, the run ended with a typed status and a message for the
    # user, within its step limit, and no booking happened twice.
    assert result.status in (
        "completed",
        "step_limit",
        "time_limit",
        "loop_detected",
        "tool_retry_limit",
        "model_failed",
        "invalid_output",
    )
    assert result.final_message.role == "assistant" and result.final_message.content
    assert len(result.steps) <= 4
    assert all(count == 1 for count in airline.bookings_per_trip().values())
    assert (result.error is None) == (result.status == "completed")
    database.close()
