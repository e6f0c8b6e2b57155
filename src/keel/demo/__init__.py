"""``keel demo``: the flight-booking agent over a long conversation, killed and resumed."""

from __future__ import annotations

from keel.demo._flights import (
    Airline,
    FlightUser,
    TripPlan,
    demo_machine,
    flight_tools,
    plans,
    policy_model,
    question_slot,
)

__all__ = [
    "Airline",
    "FlightUser",
    "TripPlan",
    "demo_machine",
    "flight_tools",
    "plans",
    "policy_model",
    "question_slot",
]
