"""Declarative state machines: where a workflow is, where it may go, and how to resume it.

A ``StateMachine`` is defined once (states, transitions with guards, per-state instructions and
allowed tools) and checked when defined: unknown names, unreachable states and dead ends raise
``StateDefinitionError``. The position of one session in it is a ``MachinePosition``, a frozen
value that lives in the session's typed state; every operation returns a new position, so a
refused transition changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from keel.errors import InvalidTransitionError, StateDefinitionError, UsageError

__all__ = ["Guard", "MachinePosition", "MachineState", "StateMachine", "Transition"]


class MachinePosition(BaseModel):
    """Where one session is in a state machine, and what it has gathered so far."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    state: str = Field(min_length=1, description="The current state.")
    slots: dict[str, Any] = Field(
        default_factory=dict, description="Values gathered so far (slot name -> JSON value)."
    )
    retries: dict[str, int] = Field(
        default_factory=dict, description="Failed attempts per state since it was last entered."
    )
    path: list[str] = Field(
        default_factory=list, description="States visited, in order, the current one last."
    )
    failure_reason: str | None = Field(
        default=None, description="Why the machine went to its failure state, if it did."
    )


Guard = Callable[[MachinePosition], bool]
"""A predicate on the position (with the transition's slots already applied)."""


@dataclass(frozen=True)
class MachineState:
    """One state of a machine.

    Attributes:
        name: unique name.
        description: what this state is for, shown to the model on resume.
        instructions: what the model should do in this state (the resume instruction).
        tools: tools the model may call in this state (empty: none).
        collects: slot names this state gathers; on resume, gathered ones are listed as known.
        terminal: the workflow ends here; it needs no outgoing transition.
        max_retries: failed attempts allowed here before the machine moves to its failure
            state (None: unlimited).
        awaits_user: what this state waits for from the user (a confirmation, a document),
            said in its resume prompt: the model asks for it and acts only once it is given.
    """

    name: str
    description: str = ""
    instructions: str = ""
    tools: tuple[str, ...] = ()
    collects: tuple[str, ...] = ()
    terminal: bool = False
    max_retries: int | None = 3
    awaits_user: str | None = None


@dataclass(frozen=True)
class Transition:
    """An allowed move ``source -> target``, taken only when ``guard`` (if any) passes."""

    source: str
    target: str
    guard: Guard | None = None
    description: str = ""
    requires: tuple[str, ...] = field(default=())
    """Slots that must be gathered before this transition is allowed (a declarative guard)."""

    def allows(self, position: MachinePosition) -> bool:
        """Whether this transition may be taken from ``position``."""
        if any(position.slots.get(name) in (None, "") for name in self.requires):
            return False
        return self.guard is None or bool(self.guard(position))


class StateMachine:
    """A validated, declarative state machine.

    Args:
        name: the workflow's name.
        states: every state.
        transitions: the table of allowed moves.
        initial: where new sessions start.
        failure: the state a machine moves to when a state's retry limit is exceeded (it may
            be reached from any state with a retry limit without a table entry).

    Raises:
        StateDefinitionError: duplicate or unknown states, unreachable states, dead ends
            (non-terminal states with no way out, or from which no terminal state is
            reachable), or no terminal state.
    """

    def __init__(
        self,
        name: str,
        *,
        states: Sequence[MachineState],
        transitions: Sequence[Transition],
        initial: str,
        failure: str | None = None,
    ) -> None:
        self.name = name
        self.states: dict[str, MachineState] = {}
        for state in states:
            if state.name in self.states:
                raise StateDefinitionError(f"{name}: state {state.name!r} is defined twice")
            if state.max_retries is not None and state.max_retries < 0:
                raise StateDefinitionError(f"{name}: {state.name}.max_retries must be >= 0")
            self.states[state.name] = state
        self.transitions = tuple(transitions)
        self.initial = initial
        self.failure = failure
        self._outgoing: dict[str, list[Transition]] = {state: [] for state in self.states}
        self._validate()

    def _validate(self) -> None:
        problems: list[str] = []
        for label, value in (("initial", self.initial), ("failure", self.failure)):
            if value is not None and value not in self.states:
                problems.append(f"{label} state {value!r} is not defined")
        seen: set[tuple[str, str]] = set()
        for transition in self.transitions:
            for end in (transition.source, transition.target):
                if end not in self.states:
                    problems.append(
                        f"transition {transition.source} -> {transition.target} names "
                        f"unknown state {end!r}"
                    )
            if (transition.source, transition.target) in seen:
                problems.append(f"transition {transition.source} -> {transition.target} twice")
            seen.add((transition.source, transition.target))
            if transition.source in self._outgoing:
                self._outgoing[transition.source].append(transition)
        if problems:
            raise StateDefinitionError(f"{self.name}: " + "; ".join(problems))
        edges = self._edges()
        reachable = _closure([self.initial], edges)
        unreachable = [state for state in self.states if state not in reachable]
        if unreachable:
            problems.append(f"unreachable from {self.initial!r}: {', '.join(unreachable)}")
        terminals = [state.name for state in self.states.values() if state.terminal]
        if not terminals:
            problems.append("no terminal state: the workflow can never end")
        for state in self.states.values():
            if not state.terminal and not self._outgoing[state.name]:
                problems.append(f"dead end: {state.name!r} is not terminal and has no way out")
        reverse: dict[str, set[str]] = {state: set() for state in self.states}
        for source, targets in edges.items():
            for target in targets:
                reverse[target].add(source)
        can_finish = _closure(terminals, reverse)
        trapped = [
            state
            for state in self.states
            if state not in can_finish and self._outgoing.get(state) and state in reachable
        ]
        if trapped:
            problems.append(f"dead end: no terminal state reachable from {', '.join(trapped)}")
        if problems:
            raise StateDefinitionError(f"{self.name}: " + "; ".join(problems))

    def _edges(self) -> dict[str, set[str]]:
        edges: dict[str, set[str]] = {state: set() for state in self.states}
        for transition in self.transitions:
            edges[transition.source].add(transition.target)
        if self.failure is not None:
            for state in self.states.values():
                if state.max_retries is not None and state.name != self.failure:
                    edges[state.name].add(self.failure)
        return edges

    # --- positions ----------------------------------------------------------------------------

    def start(self, **slots: Any) -> MachinePosition:
        """A new position in the initial state."""
        return MachinePosition(state=self.initial, slots=dict(slots), path=[self.initial])

    def _state(self, position: MachinePosition) -> MachineState:
        try:
            return self.states[position.state]
        except KeyError:
            raise UsageError(
                f"position is in state {position.state!r}, which machine {self.name!r} lacks"
            ) from None

    def allowed(self, position: MachinePosition) -> list[str]:
        """Targets reachable from ``position`` right now (guards evaluated)."""
        self._state(position)
        return [t.target for t in self._outgoing[position.state] if t.allows(position)]

    def fill(self, position: MachinePosition, **slots: Any) -> MachinePosition:
        """A position with more slots gathered (the state does not change)."""
        return position.model_copy(update={"slots": {**position.slots, **slots}})

    def transition(self, position: MachinePosition, target: str, **slots: Any) -> MachinePosition:
        """Move to ``target``, gathering ``slots`` first (guards see them).

        Raises:
            InvalidTransitionError: not in the table, or its guard refuses; ``allowed`` lists
                the moves possible now. Nothing changes (positions are immutable).
        """
        current = self._state(position)
        candidate = self.fill(position, **slots) if slots else position
        for transition in self._outgoing[current.name]:
            if transition.target == target and transition.allows(candidate):
                retries = {k: v for k, v in candidate.retries.items() if k != current.name}
                return candidate.model_copy(
                    update={
                        "state": target,
                        "retries": retries,
                        "path": [*candidate.path, target],
                        "failure_reason": None,
                    }
                )
        raise InvalidTransitionError(current.name, target, self.allowed(candidate))

    def record_failure(self, position: MachinePosition, reason: str) -> MachinePosition:
        """Count a failed attempt in the current state; past its retry limit, move to the
        failure state (with ``reason`` recorded).

        Raises:
            UsageError: the limit is exceeded and the machine has no failure state.
        """
        current = self._state(position)
        count = position.retries.get(current.name, 0) + 1
        retries = {**position.retries, current.name: count}
        if current.max_retries is not None and count > current.max_retries:
            if self.failure is None:
                raise UsageError(
                    f"{self.name}: {current.name!r} exceeded {current.max_retries} retries and "
                    "the machine has no failure state"
                )
            return position.model_copy(
                update={
                    "state": self.failure,
                    "retries": {k: v for k, v in retries.items() if k != current.name},
                    "path": [*position.path, self.failure],
                    "failure_reason": f"{current.name}: {reason} (after {count} attempts)",
                }
            )
        return position.model_copy(update={"retries": retries})

    def tools(self, position: MachinePosition) -> tuple[str, ...]:
        """Tools the model may call in the current state."""
        return self._state(position).tools

    def is_terminal(self, position: MachinePosition) -> bool:
        """Whether the workflow has ended."""
        return self._state(position).terminal

    def missing_slots(self, position: MachinePosition) -> list[str]:
        """Slots some state collects that are not gathered yet, in definition order."""
        missing: list[str] = []
        for state in self.states.values():
            for slot in state.collects:
                if position.slots.get(slot) in (None, "") and slot not in missing:
                    missing.append(slot)
        return missing

    def resume_prompt(self, position: MachinePosition) -> str:
        """Instructions that tell the model exactly where it left off and what it already has.

        Gathered slots are listed with their values and an explicit "do not ask again"; the
        current state's instructions, allowed tools and next possible steps follow.
        """
        current = self._state(position)
        lines = [f"You are resuming the {self.name!r} workflow."]
        step = f"Current step: {current.name}"
        lines.append(f"{step} - {current.description}" if current.description else step)
        if position.slots:
            known = "; ".join(
                f"{key} = {_render(value)}"
                for key, value in position.slots.items()
                if value not in (None, "")
            )
            lines.append(f"Already known (do not ask for these again): {known}.")
        missing = self.missing_slots(position)
        if missing:
            lines.append(f"Still needed: {', '.join(missing)}.")
        if current.instructions:
            lines.append(f"What to do now: {current.instructions}")
        if current.awaits_user:
            lines.append(
                f"This step waits for the user: {current.awaits_user}. If they have not given "
                "it yet, ask for it and do nothing else until they do."
            )
        lines.append(
            f"Tools allowed now: {', '.join(current.tools)}."
            if current.tools
            else "No tools are allowed in this step."
        )
        nexts = self.allowed(position)
        if nexts:
            lines.append(f"Possible next steps: {', '.join(nexts)}.")
        attempts = position.retries.get(current.name, 0)
        if attempts and current.max_retries is not None:
            lines.append(
                f"Attempts that failed in this step: {attempts} of {current.max_retries} allowed."
            )
        if position.failure_reason:
            lines.append(f"The workflow failed: {position.failure_reason}.")
        if current.terminal:
            lines.append("This workflow is finished; do not start it again unless asked.")
        return "\n".join(lines)

    def describe(self) -> Mapping[str, list[str]]:
        """The transition table: state -> targets."""
        return {state: [t.target for t in out] for state, out in self._outgoing.items()}


def _render(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return ", ".join(str(item) for item in value)
    return str(value)


def _closure(start: Iterable[str], edges: Mapping[str, set[str]]) -> set[str]:
    seen = set(start)
    frontier = list(seen)
    while frontier:
        node = frontier.pop()
        for nxt in edges.get(node, ()):
            if nxt not in seen:
                seen.add(nxt)
                frontier.append(nxt)
    return seen
