"""The tools' half of a loop step: the decision journalled, then each call past the loop
detector, the gate it was built with (``refuse``: the workflow's, or a loop's hook), and the
step's own approval hold (`ApprovalHold`) to the executor (validated, repaired, journalled
exactly once, run, its output bounded) (see `keel.runtime._loop_run`).

The step is given data, never its driver: the gate and the lease check come at construction
(``refuse``, ``facts.before_side_effect``), the events go to a sink (``events``), and the
driver's state fingerprint comes in with `ToolStep.finish` once the calls ran."""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from keel.context import runtime_note
from keel.errors import KeelError, StoreError, ToolError
from keel.guards import GuardConfig, LoopSignal
from keel.messages import Message, ToolCall
from keel.models import Completion
from keel.privacy import NoVault, UserVault
from keel.runtime._approvals import ApprovalHold, Approvals, TurnFacts
from keel.runtime._loop_run import (
    LoopRun,
    LoopStatus,
    LoopStop,
    MaybeAwaitable,
    ModelOutcome,
    StepAction,
    blocked,
    call_hook,
    decision_scope,
)
from keel.tools import ToolExecutor, ToolJournal, ToolRegistry, ToolResult, ToolScope

__all__ = ["ToolEvents", "ToolStep"]

logger = logging.getLogger("keel.runtime")


class ToolEvents(Protocol):
    """Where a step's tool events go as they happen (a streamed turn's events, a loop's
    hooks); sync or async."""

    def on_tool_start(self, step: int, call: ToolCall, arguments: dict[str, Any]) -> None:
        """Right before a validated call runs."""

    def on_tool_result(self, step: int, result: ToolResult) -> MaybeAwaitable[None]:
        """As each call ends."""


class ToolStep:
    """The tools' half of a step (see the module docstring).

    Args:
        registry: the tools the model may call.
        journal: the exactly-once journal (each side-effecting call is claimed in it).
        guards: the tool timeout, output bound and retry cap.
        redact: masks what is journalled: each call's arguments and result, and the step's
            decision (None: journalled as they are).
        scope: what each call's [`ToolContext`][] carries.
        vault: the user's view of the PII vault: placeholders in a call's arguments are
            resolved for the tool ([`NoVault`][]: refused; None: used as
            written).
        facts: the turn's facts (who, which session and turn, its trace and events), for the
            step's approval hold.
        approvals: the agent's approvals: where a call that needs a person's decision waits
            (None: such a call is refused, never run).
        aredact: ``redact`` for the event loop (the agent's masking places a new value in the
            PII vault off it); ``redact`` is used where none is given.
        refuse: ``(call) -> reason | None``, asked before a call is validated, journalled or
            run (the workflow's gate at its current position, or a loop's hook).
        events: where the tool events go (None: nowhere).
    """

    def __init__(
        self,
        registry: ToolRegistry,
        journal: ToolJournal | None,
        *,
        guards: GuardConfig,
        redact: Callable[[str], str] | None = None,
        scope: ToolScope | None = None,
        vault: UserVault | NoVault | None = None,
        facts: TurnFacts,
        approvals: Approvals | None = None,
        aredact: Callable[[str], Awaitable[str]] | None = None,
        refuse: Callable[[ToolCall], MaybeAwaitable[str | None]] | None = None,
        events: ToolEvents | None = None,
    ) -> None:
        self.registry = registry
        self.refuse = refuse
        self.events = events
        self.guards = guards
        self.redact = redact
        self.aredact = aredact
        self.executor = ToolExecutor(
            registry,
            journal=journal,
            timeout_s=guards.tool_timeout_s,
            max_output_chars=guards.max_output_chars,
            redact=redact,
            scope=scope,
            vault=vault,
            aredact=aredact,
        )
        self.journal = self.executor.journal
        self.hold = ApprovalHold(approvals, facts, self.executor)
        """Consulted for every call that passed the gate, before the executor: a call that
        waits for a person's decision is held back here, whoever drives the loop."""

    async def __call__(self, run: LoopRun, outcome: ModelOutcome) -> StepCalls:
        """Carry out the calls of ``outcome`` (journalled first when one has side effects);
        the driver ends the step with `finish`.

        Raises:
            LoopStop: a call in doubt, a tool that kept failing (the step finished).
        """
        message = outcome.message
        if not outcome.replayed and any(
            (found := self.registry.get(call.name)) is not None and found.side_effect
            for call in message.tool_calls
        ):
            try:
                message = await self._record_decision(decision_scope(run), run.step, message)
            except StoreError:
                logger.exception("could not journal the decision of step %s", run.step)
        run.history.append(message)
        calls = StepCalls(run, outcome.completion, message, outcome.replayed)
        for index, call in enumerate(message.tool_calls):
            await self._run_call(calls, index, call)
        return calls

    def finish(self, calls: StepCalls, fingerprint: str | None) -> None:
        """End the step whose calls ran: progress judged against the driver's state
        ``fingerprint`` (None: the driver has none), keel's advice added, the record finished.

        Raises:
            LoopStop: the step made no progress for too long (the step finished).
        """
        run = calls.run
        run.outcomes.update((r.tool, r.raw_arguments, r.content) for r in calls.results)
        if fingerprint is not None:
            # Progress is the state moving OR a call never seen before with a result never
            # seen before: an agent without a workflow calling twelve different tools is
            # working, not looping (repeats are the loop detector's business).
            calls.signal(run.detector.check_progress(f"{fingerprint}|{len(run.outcomes)}"))
        # keel's advice, marked as keel's: summaries and memory leave it out.
        run.history.extend(runtime_note(note, reason="loop") for note in calls.notes)
        calls.finish("tool_calls", fingerprint=fingerprint)
        run.failures_in_a_row = 0

    async def _run_call(self, calls: StepCalls, index: int, call: ToolCall) -> None:
        run, events = calls.run, self.events
        signal = run.detector.check_call(call.name, call.arguments)
        if signal is not None:
            calls.signal(signal)
            repeat = blocked(call, "Not executed: this repeats earlier calls without progress.")
            calls.add(repeat)
            if events is not None:
                await call_hook(events.on_tool_result, run.step, repeat)
            return
        refusal = await call_hook(self.refuse, call)
        held = None if refusal is not None else await self.hold.consult(run, index, call)
        if held is not None:
            # Waits for a person's decision: nothing journalled, nothing run.
            result = held
        elif refusal is not None:
            # Refused before anything is journalled or run: a failed call for the model.
            result = ToolResult(
                call_id=call.id,
                tool=call.name,
                status="blocked",
                content=f"Error: {refusal}",
                raw_arguments=call.arguments,
                error=refusal,
                error_type="UsageError",
            )
        else:
            found = self.registry.get(call.name)
            if found is not None and found.side_effect:
                # A worker that stalled past its lease never acts on a session another took.
                await call_hook(self.hold.facts.before_side_effect, call)
            result = await self.executor.execute(
                call,
                session_id=run.session_id,
                step=run.step,
                call_index=index,
                turn_id=run.turn_id,
                on_start=None
                if events is None
                else functools.partial(events.on_tool_start, run.step, call),
            )
        calls.add(result)
        if events is not None:
            await call_hook(events.on_tool_result, run.step, result)
        if held is None:
            self._count(calls, call, result)

    def _count(self, calls: StepCalls, call: ToolCall, result: ToolResult) -> None:
        """What the guards make of a call's result: repairs, doubt, failures, loops."""
        run = calls.run
        if result.repairs:
            run.repairs += 1
            calls.events.append(f"repaired {call.name} arguments: {'; '.join(result.repairs)}")
        if result.status == "in_doubt":
            assert result.exception is not None
            run.errors.append(str(result.exception))
            calls.stop("tool_in_doubt", result.exception)
        if not result.ok:
            run.errors.append(result.error or result.status)
        key = call.name if call.name in self.registry else "<unknown tools>"
        if result.ok:
            run.tool_failures[key] = 0
        else:
            run.tool_failures[key] = run.tool_failures.get(key, 0) + 1
            if run.tool_failures[key] > self.guards.max_tool_retries:
                error = result.exception or ToolError(result.error or result.status)
                what = (
                    f"the tool {call.name!r} kept failing ({result.error})"
                    if key != "<unknown tools>"
                    else "I kept trying to use tools that do not exist"
                )
                calls.stop("tool_retry_limit", error, what)
        calls.signal(run.detector.check_error(call.name, None if result.ok else result.content))

    async def _record_decision(self, session_id: str, step: int, message: Message) -> Message:
        """Journal the step's decision (masked) and return the one to carry out."""
        if self.redact is None:
            return await self.journal.arecord_decision(session_id, step, message)
        try:
            masked = await _masked_message(message, self.redact, self.aredact)
        except Exception:
            # Never journal it raw. Replay only saves a model call on resume: each
            # side-effecting call is still claimed in the journal before it runs.
            logger.exception("could not mask the decision of step %s; not journalled", step)
            return message
        recorded = await self.journal.arecord_decision(session_id, step, masked)
        # Ours was written: carry out the calls as the model made them. Another run's decision
        # was there first: carry out that one, as the journal keeps it.
        if recorded.model_dump(mode="json") == masked.model_dump(mode="json"):
            return message
        return recorded


class StepCalls:
    """The tool calls of one step as they run: results, guard events, advice for the model."""

    def __init__(
        self, run: LoopRun, completion: Completion | None, message: Message, replayed: bool
    ) -> None:
        self.run = run
        self.completion = completion
        self.message = message
        self.replayed = replayed
        self.results: list[ToolResult] = []
        self.events: list[str] = []
        self.notes: list[str] = []

    def add(self, result: ToolResult) -> None:
        self.results.append(result)
        self.run.history.append(result.to_message())

    def signal(self, signal: LoopSignal | None) -> None:
        """Count a loop signal: a warning is advice for the model, a stop ends the run."""
        if signal is None:
            return
        self.run.loops += 1
        self.events.append(f"loop {'stop' if signal.stop else 'warning'}: {signal.kind}")
        self.run.errors.append("; ".join(signal.evidence))
        if signal.stop:
            self.stop("loop_detected", signal.error())
        self.notes.append(signal.advice())

    def finish(self, action: StepAction, **options: Any) -> None:
        self.run.finish(
            action,
            self.completion,
            self.message,
            results=self.results,
            events=self.events,
            replayed=self.replayed,
            **options,
        )

    def stop(self, status: LoopStatus, error: KeelError, detail: str = "") -> None:
        """Stop the run in this step: the calls not run yet are answered, the step finished."""
        for call in self.message.tool_calls[len(self.results) :]:
            self.add(blocked(call, "Not executed: the run was stopped."))
        self.finish("stopped", error=error)
        raise LoopStop(status, error, detail)


async def _masked_message(
    message: Message,
    redact: Callable[[str], str],
    aredact: Callable[[str], Awaitable[str]] | None,
) -> Message:
    """``message`` with its text and every tool call's arguments masked (through ``aredact``
    when there is one)."""

    async def masked(text: str) -> str:
        return redact(text) if aredact is None else await aredact(text)

    calls = tuple(
        [
            call.model_copy(update={"arguments": await masked(call.arguments)})
            for call in message.tool_calls
        ]
    )
    content = await masked(message.content)
    return message.model_copy(update={"content": content, "tool_calls": calls})
