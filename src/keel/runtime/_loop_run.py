"""The state of one run of the model-and-tools loop, and what its two steps share.

A run is explicit state (`LoopRun`: the history, the steps so far, the counters the
guards read) and two steps over it, each an object configured once per run and called with
explicit inputs:

- the model step (`ModelStep`): replay the step's journalled
  decision on a resumed run, or call the model (streamed to ``on_text`` when given) with the
  prompt and the options the driver gives it, check the reply, continue an answer the token
  limit cut, and decide what comes of the reply (a final answer validated against the output
  type, a retry, a stop);
- the tool step (`ToolStep`): journal the decision, then for
  each call: the loop detector, the gate it was built with (the workflow's), the lease check
  before a side effect, the step's approval hold (a call that waits for a person), and the
  executor (validate, repair, journal exactly once, run, bound the output).

Neither calls back into its driver: each is given data (the gate, the lease, an event sink,
the driver's state fingerprint once its calls ran) and finishes its [`StepRecord`][] into the
run; the driver reads the finished ones (`LoopRun.take_finished`) and does its own bookkeeping
(checkpoint, trace) between steps. The drivers are [`ToolLoop`][] (standalone,
with [`LoopHooks`][]) and the agent's `TurnRunner`.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias, TypeVar, overload

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_serializer
from pydantic_core import to_jsonable_python

from keel.errors import (
    KeelError,
    MalformedResponseError,
    StepLimitError,
    TimeLimitError,
)
from keel.guards import (
    GuardConfig,
    LoopDetector,
    SpiralMonitor,
    SpiralSnapshot,
)
from keel.messages import Message, ToolCall, Usage
from keel.models import Completion
from keel.tools import ToolResult

logger = logging.getLogger("keel.runtime")

__all__ = [
    "History",
    "LoopResult",
    "LoopRun",
    "LoopStatus",
    "LoopStop",
    "ModelOutcome",
    "StepRecord",
    "blocked",
    "call_hook",
    "decision_scope",
    "time_limit",
]

LoopStatus = Literal[
    "completed",
    "step_limit",
    "time_limit",
    "loop_detected",
    "tool_retry_limit",
    "tool_in_doubt",
    "model_failed",
    "invalid_output",
    "awaiting_approval",
]
"""How a run ended. Only ``completed`` is a real answer; ``awaiting_approval`` is parked (a
call waits for a person's decision, the model is not asked again until it is in); every
other status carries an error."""

StepAction = Literal["tool_calls", "final", "continued", "retry", "stopped"]

T = TypeVar("T")
MaybeAwaitable: TypeAlias = T | Awaitable[T]
_USER_MESSAGES: dict[LoopStatus, str] = {
    "step_limit": (
        "I'm sorry, I could not finish this within the number of steps I'm allowed. "
        "Nothing more was changed. Could you narrow the request down, or try again?"
    ),
    "time_limit": (
        "I'm sorry, this took longer than I'm allowed to spend on one request. "
        "Nothing more was changed. Could you try again, perhaps with a simpler request?"
    ),
    "loop_detected": (
        "I'm sorry, I kept repeating the same steps without making progress, so I stopped. "
        "Could you give me more details or rephrase what you need?"
    ),
    "tool_retry_limit": (
        "I'm sorry, I could not complete this: {detail}. Could you check the details you "
        "gave me, or tell me how you'd like to proceed?"
    ),
    "tool_in_doubt": (
        "An action I started was interrupted and I cannot tell whether it went through, so "
        "I have not repeated it. A person will check it and get back to you."
    ),
    "model_failed": (
        "I'm sorry, I'm having trouble producing an answer right now. Please try again in a moment."
    ),
    "invalid_output": (
        "I'm sorry, I could not produce an answer in the required format. Please try again."
    ),
}


class StepRecord(BaseModel):
    """One step (one model call and the tool calls it asked for), with what a trace needs."""

    model_config = ConfigDict(frozen=True)

    step: int = Field(description="The step number (unique within the session).")
    action: Literal["tool_calls", "final", "continued", "retry", "stopped"] = Field(
        description=(
            "What came of it: tool calls run, a final answer, an answer cut at the token limit "
            "that the next step continues, a retry (unusable reply or model failure), or the "
            "run stopped inside the step."
        )
    )
    started_at: float = Field(description="Unix time the step started.")
    latency_ms: float = Field(ge=0, description="Wall time of the whole step.")
    model_latency_ms: float | None = Field(
        default=None,
        description="Wall time of the model call (None if replayed; a failed call has one too).",
    )
    ttft_ms: float | None = Field(default=None, description="Time to first token, if known.")
    model: str = Field(default="", description="The model that answered.")
    prompt_messages: int = Field(default=0, description="Messages sent to the model.")
    raw_output: str | None = Field(
        default=None, description="The reply's text exactly as the model produced it."
    )
    response: Message | None = Field(default=None, description="The parsed assistant message.")
    finish_reason: str | None = Field(default=None, description="Why generation ended.")
    usage: Usage = Field(default_factory=Usage, description="Tokens of the model call.")
    replayed_decision: bool = Field(
        default=False,
        description="True when the tool calls came from the journal (a resumed run).",
    )
    tool_results: tuple[ToolResult, ...] = Field(
        default=(), description="Every tool call of the step: name, arguments, result, error."
    )
    guard_events: tuple[str, ...] = Field(
        default=(), description="What the guards saw: loop warnings, unusable replies."
    )
    error: str | None = Field(default=None, description="The step's error, if any.")
    error_type: str | None = Field(default=None, description="The error's class name.")
    state_fingerprint: str | None = Field(
        default=None, description="The state fingerprint after the step, if a hook gives one."
    )
    answer_parts: int = Field(
        default=0,
        description="Parts of an answer cut at the token limit that stand after the step, to "
        "be continued by the next one (0: none).",
    )


class LoopResult(BaseModel):
    """How a run ended: the message for the user, the steps, and the error if it failed."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    status: LoopStatus = Field(description="How the run ended.")
    final_message: Message = Field(
        description="The answer, or a clean explanation for the user when the run stopped "
        "(keel's words, ``metadata['keel_stop']`` set: not in ``new_messages``)."
    )
    output: Any = Field(
        default=None, description="The validated structured answer, with an output schema."
    )
    new_messages: list[Message] = Field(description="The messages this run added.")
    steps: list[StepRecord] = Field(description="Every step, in order.")
    error: KeelError | None = Field(
        default=None, exclude=True, description="The typed error when the run did not complete."
    )
    error_message: str | None = Field(default=None, description="The error's text.")
    errors: list[str] = Field(
        default_factory=list, description="Every error met on the way (tools, model, guards)."
    )
    usage: Usage = Field(default_factory=Usage, description="Tokens of all model calls.")
    next_step: int = Field(
        description="The step number the session's next run starts at (``first_step``)."
    )
    duration_ms: float = Field(ge=0, description="Wall time of the run.")
    reverted: bool = Field(
        default=False, description="True when the revert_to_last_good hook was called."
    )
    truncated: bool = Field(
        default=False,
        description="The answer is cut: it kept reaching the token limit, and the run's step or "
        "time limit came before it could be continued to its end (``status`` is completed: "
        "the answer is what the model wrote, not all it would have).",
    )
    loops_detected: int = Field(default=0, description="Loop detections (warnings and stop).")
    repairs: int = Field(default=0, description="Tool calls whose arguments were repaired.")
    spiral: SpiralSnapshot | None = Field(
        default=None, description="Death-spiral indicators of the session after the run."
    )

    _earlier: Callable[[], list[Message]] = PrivateAttr(default=list)

    @field_serializer("output")
    def _serialize_output(self, output: Any) -> Any:
        return to_jsonable_python(output, fallback=str)

    @property
    def messages(self) -> list[Message]:
        """The whole conversation after the run: the messages it started from, then
        ``new_messages``. Built when asked for, so a run's cost does not grow with the
        conversation it continues."""
        return [*self._earlier(), *self.new_messages]

    @property
    def ok(self) -> bool:
        """True when the run completed with an answer."""
        return self.status == "completed"

    @property
    def text(self) -> str:
        """The final message's text."""
        return self.final_message.content

    def raise_for_status(self) -> LoopResult:
        """Raise the run's typed error if it did not complete; else return self."""
        if self.error is not None:
            raise self.error
        return self


class History(Sequence[Message]):
    """A run's conversation: the messages it started from, then the messages the run added.

    The earlier messages are not copied: the history is the first ``len(prior)`` items of the
    caller's sequence as the run starts (the caller may append to it meanwhile, never change
    those items), so what a step costs does not grow with the session's length. The hook reads
    the run's messages past those it already has; only a loop without a ``before_model_call``
    hook sends, and so copies, the whole history."""

    __slots__ = ("added", "prior", "prior_len")

    def __init__(self, prior: Sequence[Message]) -> None:
        self.prior = prior
        self.prior_len = len(prior)
        self.added: list[Message] = []

    def append(self, message: Message) -> None:
        self.added.append(message)

    def extend(self, messages: Iterable[Message]) -> None:
        self.added.extend(messages)

    def earlier(self) -> list[Message]:
        """The messages the run started from, as a list of the caller's own."""
        return list(itertools.islice(self.prior, self.prior_len))

    def __len__(self) -> int:
        return self.prior_len + len(self.added)

    def __iter__(self) -> Iterator[Message]:
        yield from itertools.islice(self.prior, self.prior_len)
        yield from self.added

    @overload
    def __getitem__(self, index: int) -> Message: ...

    @overload
    def __getitem__(self, index: slice) -> list[Message]: ...

    def __getitem__(self, index: int | slice) -> Message | list[Message]:
        start = self.prior_len
        if isinstance(index, slice):
            first, stop, stride = index.indices(len(self))
            if stride == 1 and first >= start:
                return self.added[first - start : max(stop - start, 0)]
            return list(self)[index]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError("history index out of range")
        return self.prior[index] if index < start else self.added[index - start]


class LoopStop(Exception):
    """The run stops here: how, the typed error, and a detail for the user's message."""

    def __init__(self, status: LoopStatus, error: KeelError, detail: str = "") -> None:
        self.status = status
        self.error = error
        self.detail = detail
        super().__init__(str(error))


@dataclass(frozen=True)
class ModelOutcome:
    """What one model step produced: ``kind`` is ``tool_calls``, ``final``, ``retry``,
    ``continued`` (a cut answer the next step goes on with) or ``cut`` (a cut answer that
    stands, ``continue_truncated`` off)."""

    kind: Literal["tool_calls", "final", "retry", "continued", "cut"]
    completion: Completion | None
    message: Message
    replayed: bool = False


@dataclass
class LoopRun:
    """The state of one run: its history, its steps, and what the guards count."""

    session_id: str
    turn_id: str | None
    history: History
    started: float
    detector: LoopDetector
    tools: list[dict[str, Any]]
    model: str
    """The model's spec, for a step that failed before any answer."""
    output_schema: type[Any] | None
    monitor: SpiralMonitor
    steps: list[StepRecord] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    usage: Usage = field(default_factory=Usage)
    loops: int = 0
    repairs: int = 0
    step: int = 0
    current: dict[str, Any] | None = None
    retrying: bool = False
    last_failure: KeelError | None = None
    outcomes: set[tuple[str, str, str]] = field(default_factory=set)
    """Distinct (tool, arguments, result) seen: a new one is progress, whatever the state."""
    cut_parts: list[str] = field(default_factory=list)
    """The answer so far, when replies cut at the token limit are being continued."""
    steps_taken: int = 0
    failures_in_a_row: int = 0
    output_retries: int = 0
    tool_failures: dict[str, int] = field(default_factory=dict)
    reported: int = 0
    """Finished steps the driver has taken (see `take_finished`)."""
    agent: str | None = None
    decided_before: bool = True
    """Whether a run before this one may have journalled the decision of its first step
    (False: a turn keel has just opened under an id it made, which nothing else knows)."""

    def begin(self, guards: GuardConfig) -> None:
        """Start a step, or stop: the step limit is reached, the deadline passed."""
        if self.steps_taken >= guards.max_steps:
            limit = StepLimitError(
                f"run reached its limit of {guards.max_steps} steps without an answer"
            )
            raise LoopStop("step_limit", limit)
        if time.perf_counter() - self.started >= guards.run_timeout_s:
            raise TimeoutError  # the run's deadline passed between awaits
        self.steps_taken += 1
        self.current = {"step": self.step, "started_at": time.time(), "t0": time.perf_counter()}

    def finish(
        self,
        action: StepAction,
        completion: Completion | None,
        message: Message | None,
        *,
        results: Sequence[ToolResult] = (),
        events: Sequence[str] = (),
        error: BaseException | None = None,
        replayed: bool = False,
        fingerprint: str | None = None,
    ) -> None:
        """Record the step in flight as ended with ``action``; the next one gets a new number."""
        current = self.current or {"started_at": time.time(), "t0": time.perf_counter()}
        record = StepRecord(
            step=self.step,
            action=action,
            started_at=current["started_at"],
            latency_ms=(time.perf_counter() - current["t0"]) * 1000,
            model_latency_ms=completion.latency_ms if completion is not None else None,
            ttft_ms=completion.ttft_ms if completion is not None else None,
            model=completion.model if completion is not None else self.model,
            prompt_messages=int(current.get("prompt_messages", 0)),
            raw_output=message.content if message is not None else None,
            response=message,
            finish_reason=completion.finish_reason if completion is not None else None,
            usage=completion.usage if completion is not None else Usage(),
            replayed_decision=replayed,
            tool_results=tuple(results),
            guard_events=tuple(events),
            error=None if error is None else str(error),
            error_type=None if error is None else type(error).__name__,
            state_fingerprint=fingerprint,
            answer_parts=len(self.cut_parts),
        )
        self.steps.append(record)
        self.current = None
        self.step += 1

    def take_finished(self) -> list[StepRecord]:
        """The steps finished since the driver last asked, in order."""
        finished = self.steps[self.reported :]
        self.reported = len(self.steps)
        return finished

    def halt(self, stop: LoopStop) -> LoopResult | LoopStop:
        """End the run at ``stop``: the step in flight is recorded as stopped and the open tool
        calls answered. An answer being continued when a limit came is the answer, reported
        cut (returned as the result); with an output type a cut answer is none."""
        if stop.status in ("step_limit", "time_limit") and self.cut_parts:
            why = f"the answer was cut: {stop.error}"
            if self.current is not None:
                self.finish("stopped", None, None, error=stop.error, events=(why,))
            if self.output_schema is None:
                self.errors.append(why)
                answer = Message.assistant("".join(self.cut_parts))
                self.history.append(answer)
                return self.result("completed", answer, truncated=True)
            stop = LoopStop("invalid_output", MalformedResponseError(why, model=self.model))
        if self.current is not None:
            # The run was interrupted inside a step (the time limit): record what is known.
            self.finish("stopped", None, None, error=stop.error)
        _close_open_calls(self.history)
        self.errors.append(f"{type(stop.error).__name__}: {stop.error}")
        return stop

    def stopped(self, stop: LoopStop, *, reverted: bool) -> LoopResult:
        """The result of a run that `halt` ended at ``stop`` (``reverted``: the driver
        went back to its last good state)."""
        if reverted:
            self.monitor.record_state_reset(session_id=self.session_id, agent=self.agent)
        template = _USER_MESSAGES[stop.status]
        text = template.format(detail=stop.detail or str(stop.error))
        # keel's words for the user, not the model's: the run's history does not hold them, so
        # a caller that continues from ``messages`` never shows the model an apology as its own.
        final = Message.assistant(text, metadata={"keel_stop": stop.status})
        return self.result(stop.status, final, error=stop.error, reverted=reverted)

    def result(
        self,
        status: LoopStatus,
        final: Message,
        *,
        output: Any = None,
        error: KeelError | None = None,
        reverted: bool = False,
        truncated: bool = False,
    ) -> LoopResult:
        # model_construct: every value is built here, and validating the messages would
        # re-check them all on every run.
        result = LoopResult.model_construct(
            status=status,
            final_message=final,
            output=output,
            new_messages=list(self.history.added),
            steps=list(self.steps),
            error=error,
            error_message=None if error is None else str(error),
            errors=list(self.errors),
            usage=self.usage,
            next_step=self.step,
            duration_ms=(time.perf_counter() - self.started) * 1000,
            reverted=reverted,
            truncated=truncated,
            loops_detected=self.loops,
            repairs=self.repairs,
            spiral=self.monitor.snapshot(session_id=self.session_id),
        )
        result._earlier = self.history.earlier
        return result


def time_limit(guards: GuardConfig) -> LoopStop:
    """The stop of a run that reached its wall-clock limit."""
    limit = TimeLimitError(f"run reached its wall-clock limit of {guards.run_timeout_s:g} s")
    return LoopStop("time_limit", limit)


def decision_scope(run: LoopRun) -> str:
    """Where a step's decision is journalled: per session, and per turn when one is given."""
    return run.session_id if run.turn_id is None else f"{run.session_id}#{run.turn_id}"


def blocked(call: ToolCall, text: str) -> ToolResult:
    return ToolResult(
        call_id=call.id,
        tool=call.name,
        status="blocked",
        content=text,
        raw_arguments=call.arguments,
    )


def _close_open_calls(history: History) -> None:
    """Answer every tool call of the last assistant message that has no result yet."""
    for position in range(len(history) - 1, -1, -1):
        message = history[position]
        if message.role == "assistant" and message.tool_calls:
            answered = {m.tool_call_id for m in history[position + 1 :] if m.role == "tool"}
            for call in message.tool_calls:
                if call.id not in answered:
                    history.append(
                        Message.tool(call.id, "Not executed: the run was stopped.", name=call.name)
                    )
            return
        if message.role == "user":
            return


async def call_hook(hook: Callable[..., Any] | None, *args: Any) -> Any:
    """``hook(*args)``, awaited when it returns an awaitable; None without a hook."""
    if hook is None:
        return None
    value = hook(*args)
    if inspect.isawaitable(value):
        value = await value
    return value
