"""What [`Agent.stream`][] yields while a turn runs: typed events, one union.

Every text in an event is masked by the agent's privacy policy before it is yielded, as the
committed history is. The last event of a turn that ran is always [`TurnFinished`][] with the
[`AgentReply`][], whose ``text`` is authoritative: the text deltas of a step
that turned out unusable (the model is asked again) are withdrawn by a [`TextDiscarded`][],
and a turn that fails ends with the clean message for the user in the reply.

A streamed turn's events come from its `TurnStream`: the model's text masked as it arrives
(with a PII vault, the user's placeholders revealed; a placeholder is never split), tool calls
as they start and end, and the text of a step withdrawn when the step turns out unusable;
`events_of` yields them as they happen.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from keel.messages import ToolCall
from keel.privacy import RevealStream, StreamMasker, storable
from keel.runtime._loop_run import StepRecord
from keel.runtime._masking import Masking
from keel.runtime._reply import AgentReply, PendingApproval
from keel.tools import ToolResult
from keel.tracing import redact_json

__all__ = [
    "AgentEvent",
    "ApprovalDecided",
    "ApprovalRequested",
    "CheckpointCommitted",
    "GuardWarning",
    "TextDelta",
    "TextDiscarded",
    "ToolCallFinished",
    "ToolCallStarted",
    "TurnFinished",
    "TurnStream",
    "WorkflowTransition",
    "events_of",
]


class _Event(BaseModel):
    model_config = ConfigDict(frozen=True)


class TextDelta(_Event):
    """More characters of the model's reply in ``step`` (masked; a placeholder is never split)."""

    type: Literal["text"] = "text"
    step: int = Field(description="The step (model call) the text belongs to.")
    text: str = Field(description="The new characters.")


class TextDiscarded(_Event):
    """The text streamed in ``step`` is not part of the answer: the reply was unusable (cut
    short, malformed, a failed model call) and the model is asked again. A UI clears it."""

    type: Literal["text_discarded"] = "text_discarded"
    step: int
    reason: str = Field(description="Why the step's reply was not used.")


class ToolCallStarted(_Event):
    """A tool call passed validation and runs now."""

    type: Literal["tool_call_started"] = "tool_call_started"
    step: int
    call_id: str
    name: str = Field(description="The tool.")
    arguments: dict[str, Any] = Field(description="The validated arguments (masked).")


class ToolCallFinished(_Event):
    """A tool call ended: its result for the model, or why it failed (masked)."""

    type: Literal["tool_call_finished"] = "tool_call_finished"
    step: int
    call_id: str
    name: str
    status: str = Field(description="ok, or how it failed (invalid_arguments, timeout, ...).")
    ok: bool
    result: str = Field(description="What the model is told: the output, or the error.")


class WorkflowTransition(_Event):
    """The workflow moved from one state to another."""

    type: Literal["transition"] = "transition"
    source: str = Field(description="The state it left.")
    target: str = Field(description="The state it entered.")


class CheckpointCommitted(_Event):
    """A checkpoint of the session was committed (before each model call, after a transition,
    at the end of the turn)."""

    type: Literal["checkpoint"] = "checkpoint"
    version: int = Field(description="The state version now committed.")
    reason: str = Field(description="Why it was written.")


class GuardWarning(_Event):
    """A guard saw something: a loop warning, an unusable reply, repaired arguments."""

    type: Literal["guard"] = "guard"
    step: int
    message: str


class ApprovalRequested(_Event):
    """A call waits for a person's decision before it runs (the turn parks after its step)."""

    type: Literal["approval_requested"] = "approval_requested"
    step: int
    approval: PendingApproval


class ApprovalDecided(_Event):
    """A waiting call was decided (or expired, or was cancelled): what comes of it."""

    type: Literal["approval_decided"] = "approval_decided"
    approval_id: str
    status: str = Field(description="approved, rejected, expired or cancelled.")
    by: str | None = Field(default=None, description="Who decided (None: expired, cancelled).")
    result: str = Field(description="What the model is told of it (masked).")


class TurnFinished(_Event):
    """The turn ended; ``reply`` is what [`Agent.run`][] would have returned."""

    type: Literal["final"] = "final"
    reply: AgentReply


AgentEvent = Annotated[
    TextDelta
    | TextDiscarded
    | ToolCallStarted
    | ToolCallFinished
    | WorkflowTransition
    | CheckpointCommitted
    | GuardWarning
    | ApprovalRequested
    | ApprovalDecided
    | TurnFinished,
    Field(discriminator="type"),
]
"""One event of a streamed turn (discriminated by ``type``)."""


class TurnStream:
    """Turns one streamed turn's model text, tool calls and steps into events for ``emit``."""

    def __init__(self, emit: Callable[[AgentEvent], None], masking: Masking) -> None:
        self.emit = emit
        self._masking = masking
        self._streamed: dict[int, StreamMasker | RevealStream | None] = {}
        """The steps whose reply text streamed: the masker of each (None: masking is off, the
        text went out as it came; a [`RevealStream`][] with a vault: the user's values)."""
        self._shown: set[int] = set()
        """Steps whose reply text reached the caller (in part, at least)."""
        self._continued: list[int] = []
        """Streamed steps whose answer was cut and is being continued (their text stands only
        if the answer is finished)."""

    def on_text(self, step: int, text: str) -> None:
        """More characters of ``step``'s reply: released as far as masking allows."""
        if step not in self._streamed:
            self._streamed[step] = self._masking.stream_masker()
        masker = self._streamed[step]
        # Masking off: nothing to hold back.
        released = storable(text) if masker is None else masker.feed(text)
        if released:
            self._shown.add(step)
            self.emit(TextDelta(step=step, text=released))

    def on_tool_start(self, step: int, call: ToolCall, arguments: dict[str, Any]) -> None:
        redact = self._masking.redact
        masked = arguments if redact is None else redact_json(arguments, redact)
        self.emit(ToolCallStarted(step=step, call_id=call.id, name=call.name, arguments=masked))

    def on_tool_result(self, step: int, result: ToolResult) -> None:
        self.emit(
            ToolCallFinished(
                step=step,
                call_id=result.call_id,
                name=result.tool,
                status=result.status,
                ok=result.ok,
                result=self._masking.mask_message(result.to_message()).content,
            )
        )

    def end_step(self, record: StepRecord) -> None:
        """A step ended: the rest of its streamed text, or its withdrawal; its guard events."""
        streamed = record.step in self._streamed
        masker = self._streamed.pop(record.step, None)
        shown = record.step in self._shown
        if record.action == "continued":
            # The answer goes on in the next step: one masker over all its parts, so a value
            # the cut split in two is still masked whole.
            if streamed:
                self._streamed[record.step + 1] = masker
                self._continued.append(record.step)
        elif record.answer_parts:
            # A failed call while an answer is continued: its parts stand, the next step goes
            # on. This step's own text is withdrawn (and its masker with it: the reply is
            # authoritative for a tail that masker held back).
            if shown:
                reason = self._masking.mask(record.error or "")
                self.emit(TextDiscarded(step=record.step, reason=reason))
            elif streamed:
                self._streamed[record.step + 1] = masker
        elif record.action in ("final", "tool_calls"):
            rest = masker.finish() if masker is not None else ""
            if rest:
                self.emit(TextDelta(step=record.step, text=rest))
            self._continued.clear()
        else:
            reason = self._masking.mask(record.error or "the reply could not be used")
            # An answer being continued that ends unusable takes its earlier parts with it.
            withdrawn = [*self._continued, record.step] if shown else self._continued
            for step in withdrawn:
                self.emit(TextDiscarded(step=step, reason=reason))
            self._continued.clear()
        for event in record.guard_events:
            self.emit(GuardWarning(step=record.step, message=self._masking.mask(event)))

    def release_held(self) -> None:
        """The answer ended cut while it was being continued: what a masker still holds back
        of it is part of the answer, streamed now."""
        for step, masker in self._streamed.items():
            rest = masker.finish() if masker is not None else ""
            if rest:
                self.emit(TextDelta(step=step, text=rest))


async def events_of(
    turn: Callable[[Callable[[AgentEvent], None]], Coroutine[Any, Any, AgentReply]],
) -> AsyncIterator[AgentEvent]:
    """The events ``turn`` emits through the callback it is given, as they happen, and last a
    [`TurnFinished`][] with its reply; it raises what the turn raises, where it happens.

    The turn runs as a task of its own, so a consumer that stops early (``break``,
    ``aclose``, a cancelled task) cancels it where it is, and waits for it to stop.
    """
    events: asyncio.Queue[AgentEvent | None] = asyncio.Queue()
    task = asyncio.create_task(turn(events.put_nowait))
    task.add_done_callback(lambda _: events.put_nowait(None))
    try:
        while (event := await events.get()) is not None:
            yield event
        reply = task.result()
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    yield TurnFinished(reply=reply)
