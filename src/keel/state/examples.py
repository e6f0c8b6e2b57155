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
    return StateMachine(
        "flight_booking",
        states=[
            MachineState(
                "idle",
                description="no booking in progress",
                instructions="Ask where the user wants to fly from, if they want to book a flight.",
                max_retries=None,
            ),
            *_gathering_states(),
            *_booking_states(max_retries),
        ],
        transitions=_flight_transitions(),
        initial="idle",
        failure="failed",
    )


def _gathering(
    slot: str, asking: str, instructions: str, tools: tuple[str, ...] = ()
) -> MachineState:
    """The state that asks the user for one slot."""
    return MachineState(
        f"gathering_{slot}",
        description=f"asking for {asking}",
        instructions=instructions,
        tools=tools,
        collects=(slot,),
    )


def _gathering_states() -> list[MachineState]:
    """One state per slot, in the order they are asked for."""
    airports = ("search_airports",)
    return [
        _gathering(
            "origin", "the departure city", "Ask for the departure city or airport.", airports
        ),
        _gathering(
            "destination", "the destination", "Ask for the destination city or airport.", airports
        ),
        _gathering("dates", "travel dates", "Ask for the departure (and return) dates."),
        _gathering(
            "passengers", "the number of passengers", "Ask how many passengers are travelling."
        ),
    ]


def _booking_states(max_retries: int) -> list[MachineState]:
    """From the itinerary read back to the booking done, or failed."""
    return [
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


def _flight_transitions() -> list[Transition]:
    return [
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
