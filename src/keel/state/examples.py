"""Example state machines that ship with keel (the seeds' workflows)."""

from __future__ import annotations

from keel.state._machine import MachineState, StateMachine, Transition

__all__ = ["FLIGHT_SLOTS", "flight_booking_machine"]

FLIGHT_SLOTS = ("origin", "destination", "dates", "passengers")
"""The slots a flight booking gathers, in order."""


def flight_booking_machine(*, max_retries: int = 3) -> StateMachine:
    """The flight-booking workflow.

    idle -> gathering origin -> destination -> dates -> passengers -> confirming -> booking ->
    completed; confirming may go back to gathering dates (the user changes them); booking that
    fails ``max_retries`` times moves to failed, from where the user may start over (idle) or
    return to confirming.
    """
    gather = ("search_airports",)
    states = [
        MachineState(
            "idle",
            description="no booking in progress",
            instructions="Ask where the user wants to fly from, if they want to book a flight.",
            max_retries=None,
        ),
        MachineState(
            "gathering_origin",
            description="asking for the departure city",
            instructions="Ask for the departure city or airport.",
            tools=gather,
            collects=("origin",),
        ),
        MachineState(
            "gathering_destination",
            description="asking for the destination",
            instructions="Ask for the destination city or airport.",
            tools=gather,
            collects=("destination",),
        ),
        MachineState(
            "gathering_dates",
            description="asking for travel dates",
            instructions="Ask for the departure (and return) dates.",
            collects=("dates",),
        ),
        MachineState(
            "gathering_passengers",
            description="asking for the number of passengers",
            instructions="Ask how many passengers are travelling.",
            collects=("passengers",),
        ),
        MachineState(
            "confirming",
            description="confirming the itinerary with the user",
            instructions=(
                "Read the itinerary back and ask the user to confirm it or change the dates."
            ),
            tools=("search_flights",),
        ),
        MachineState(
            "booking",
            description="booking the confirmed flight",
            instructions="Book the confirmed flight and report the booking reference.",
            tools=("book_flight",),
            max_retries=max_retries,
        ),
        MachineState(
            "completed",
            description="the flight is booked",
            instructions="Tell the user the booking reference; the booking is done.",
            terminal=True,
            max_retries=None,
        ),
        MachineState(
            "failed",
            description="booking failed",
            instructions=(
                "Apologise, explain what failed, and offer to try again (confirming) or to "
                "start over (idle)."
            ),
            max_retries=None,
        ),
    ]
    transitions = [
        Transition("idle", "gathering_origin", description="the user wants to book"),
        Transition("gathering_origin", "gathering_destination", requires=("origin",)),
        Transition("gathering_destination", "gathering_dates", requires=("destination",)),
        Transition("gathering_dates", "gathering_passengers", requires=("dates",)),
        Transition("gathering_passengers", "confirming", requires=("passengers",)),
        Transition("confirming", "gathering_dates", description="the user changes the dates"),
        Transition("confirming", "booking", requires=FLIGHT_SLOTS),
        Transition("booking", "completed", requires=("booking_reference",)),
        Transition("failed", "idle", description="start over"),
        Transition("failed", "confirming", requires=FLIGHT_SLOTS, description="try again"),
    ]
    return StateMachine(
        "flight_booking",
        states=states,
        transitions=transitions,
        initial="idle",
        failure="failed",
    )
