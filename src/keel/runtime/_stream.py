"""A streamed turn's events: the model's text masked as it arrives (with a PII vault, the
user's placeholders revealed; a placeholder is never split), tool calls as they start and end,
and the text of a step withdrawn when the step turns out unusable."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from keel.messages import ToolCall
from keel.privacy import RevealStream, StreamMasker
from keel.runtime._events import (
    AgentEvent,
    GuardWarning,
    TextDelta,
    TextDiscarded,
    ToolCallFinished,
    ToolCallStarted,
    TurnFinished,
)
from keel.runtime._masking import Masking
from keel.runtime._reply import AgentReply
from keel.runtime._steps import StepRecord
from keel.runtime._text import sanitize
from keel.tools import ToolResult
from keel.tracing import redact_json

__all__ = ["TurnStream", "events_of"]


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
        released = sanitize(text) if masker is None else masker.feed(text)
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
