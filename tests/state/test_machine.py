from __future__ import annotations

from pathlib import Path

import pytest

from keel.errors import InvalidTransitionError, StateDefinitionError, UsageError
from keel.state import AgentState, MachineState, StateMachine, StateStore, Transition
from keel.state.examples import FLIGHT_SLOTS, flight_booking_machine
from keel.testing._state_worker import state_backend_at


def _at_confirming() -> tuple[StateMachine, object]:
    machine = flight_booking_machine()
    position = machine.start()
    position = machine.transition(position, "gathering_origin")
    position = machine.transition(position, "gathering_destination", origin="BOS")
    position = machine.transition(position, "gathering_dates", destination="LIS")
    position = machine.transition(position, "gathering_passengers", dates="2026-12-01")
    position = machine.transition(position, "confirming", passengers=2)
    return machine, position


def test_flight_booking_happy_path() -> None:
    machine, position = _at_confirming()
    assert position.state == "confirming"  # type: ignore[attr-defined]
    booking = machine.transition(position, "booking")  # type: ignore[arg-type]
    assert machine.tools(booking) == ("book_flight",)
    done = machine.transition(booking, "completed", booking_reference="KX7Q2")
    assert machine.is_terminal(done)
    assert done.path == [
        "idle",
        "gathering_origin",
        "gathering_destination",
        "gathering_dates",
        "gathering_passengers",
        "confirming",
        "booking",
        "completed",
    ]
    assert {slot: done.slots[slot] for slot in FLIGHT_SLOTS} == {
        "origin": "BOS",
        "destination": "LIS",
        "dates": "2026-12-01",
        "passengers": 2,
    }


def test_transition_not_in_table_raises_and_changes_nothing() -> None:
    machine = flight_booking_machine()
    start = machine.start()
    with pytest.raises(InvalidTransitionError) as caught:
        machine.transition(start, "booking")
    assert caught.value.source == "idle" and caught.value.target == "booking"
    assert caught.value.allowed == ["gathering_origin"]
    assert start == machine.start()
    with pytest.raises(InvalidTransitionError):
        machine.transition(start, "no_such_state")


def test_guards_refuse_until_slots_are_gathered() -> None:
    machine = flight_booking_machine()
    position = machine.transition(machine.start(), "gathering_origin")
    with pytest.raises(InvalidTransitionError) as caught:
        machine.transition(position, "gathering_destination")
    assert caught.value.allowed == []
    assert machine.allowed(machine.fill(position, origin="BOS")) == ["gathering_destination"]
    guarded = StateMachine(
        "vip",
        states=[MachineState("a"), MachineState("b", terminal=True)],
        transitions=[Transition("a", "b", guard=lambda p: p.slots.get("vip") is True)],
        initial="a",
    )
    with pytest.raises(InvalidTransitionError):
        guarded.transition(guarded.start(), "b", vip=False)
    assert guarded.transition(guarded.start(), "b", vip=True).state == "b"


def test_confirming_can_go_back_to_gathering_dates() -> None:
    machine, position = _at_confirming()
    back = machine.transition(position, "gathering_dates")  # type: ignore[arg-type]
    assert back.state == "gathering_dates" and back.slots["origin"] == "BOS"
    again = machine.transition(back, "gathering_passengers", dates="2026-12-08")
    again = machine.transition(again, "confirming")
    assert again.slots["dates"] == "2026-12-08" and again.state == "confirming"


def test_retry_limit_moves_to_failed_and_failed_can_recover() -> None:
    machine, position = _at_confirming()
    booking = machine.transition(position, "booking")  # type: ignore[arg-type]
    for attempt in range(1, 4):
        booking = machine.record_failure(booking, "payment gateway timeout")
        assert booking.state == "booking" and booking.retries["booking"] == attempt
    failed = machine.record_failure(booking, "payment gateway timeout")
    assert failed.state == "failed"
    assert failed.failure_reason is not None and "after 4 attempts" in failed.failure_reason
    assert "The workflow failed" in machine.resume_prompt(failed)
    assert sorted(machine.allowed(failed)) == ["confirming", "idle"]
    retry = machine.transition(failed, "confirming")
    assert retry.failure_reason is None and retry.retries == {}
    assert machine.transition(failed, "idle").state == "idle"


def test_resume_prompt_says_where_it_left_off_and_what_it_has() -> None:
    machine = flight_booking_machine()
    position = machine.transition(machine.start(), "gathering_origin")
    position = machine.transition(position, "gathering_destination", origin="BOS")
    position = machine.transition(position, "gathering_dates", destination="LIS")
    position = machine.record_failure(position, "user gave an unparseable date")
    prompt = machine.resume_prompt(position)
    assert "Current step: gathering_dates" in prompt
    assert "do not ask for these again" in prompt
    assert "origin = BOS" in prompt and "destination = LIS" in prompt
    assert "Still needed: dates, passengers." in prompt
    assert "Ask for the departure (and return) dates." in prompt
    assert "No tools are allowed in this step." in prompt
    assert "1 of 3" in prompt


def test_position_survives_a_store_round_trip_and_resumes_identically(tmp_path: Path) -> None:
    machine, position = _at_confirming()
    store = StateStore(state_backend_at(f"sqlite:///{tmp_path / 'k.db'}"), AgentState)
    cp = store.create("trip", AgentState())
    store.update(
        "trip", {"machine": position}, expected_version=cp.version, reason="after_transition"
    )
    store.close()
    fresh = StateStore(state_backend_at(f"sqlite:///{tmp_path / 'k.db'}"), AgentState)
    loaded = fresh.load("trip").state.machine
    fresh.close()
    assert loaded == position
    assert machine.resume_prompt(loaded) == machine.resume_prompt(position)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("states", "transitions", "message"),
    [
        (
            [MachineState("a"), MachineState("b", terminal=True), MachineState("orphan")],
            [Transition("a", "b"), Transition("orphan", "b")],
            "unreachable",
        ),
        (
            [MachineState("a"), MachineState("stuck"), MachineState("end", terminal=True)],
            [Transition("a", "stuck"), Transition("a", "end")],
            "dead end: 'stuck'",
        ),
        (
            [MachineState("a"), MachineState("loop"), MachineState("end", terminal=True)],
            [
                Transition("a", "loop"),
                Transition("loop", "a"),
                Transition("a", "end"),
                Transition("loop", "loop2"),
            ],
            "unknown state",
        ),
        (
            [MachineState("a"), MachineState("b")],
            [Transition("a", "b"), Transition("b", "a")],
            "no terminal",
        ),
        (
            [
                MachineState("a"),
                MachineState("x"),
                MachineState("y"),
                MachineState("end", terminal=True),
            ],
            [
                Transition("a", "x"),
                Transition("x", "y"),
                Transition("y", "x"),
                Transition("a", "end"),
            ],
            "no terminal state reachable from x, y",
        ),
        ([MachineState("a"), MachineState("a", terminal=True)], [], "defined twice"),
    ],
)
def test_invalid_machines_are_rejected_when_defined(
    states: list[MachineState], transitions: list[Transition], message: str
) -> None:
    with pytest.raises(StateDefinitionError, match=message):
        StateMachine("m", states=states, transitions=transitions, initial="a")


def test_failure_state_must_exist_and_limits_need_it() -> None:
    with pytest.raises(StateDefinitionError, match="failure state"):
        StateMachine(
            "m",
            states=[MachineState("a"), MachineState("b", terminal=True)],
            transitions=[Transition("a", "b")],
            initial="a",
            failure="nope",
        )
    machine = StateMachine(
        "m",
        states=[MachineState("a", max_retries=0), MachineState("b", terminal=True)],
        transitions=[Transition("a", "b")],
        initial="a",
    )
    with pytest.raises(UsageError, match="no failure state"):
        machine.record_failure(machine.start(), "x")
    assert machine.describe() == {"a": ["b"], "b": []}
