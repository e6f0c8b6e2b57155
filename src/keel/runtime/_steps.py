"""The steps of the model-and-tools loop, written once for both of their drivers.

A run is explicit state (:class:`LoopRun`: the history, the steps so far, the counters the
guards read) and two steps over it, each an object configured once per run and called with
explicit inputs:

- :class:`ModelStep`: replay the step's journalled decision on a resumed run, or call the model
  (streamed to ``on_text`` when given) with the prompt and the options the driver gives it,
  check the reply, continue an answer the token limit cut, and decide what comes of the reply
  (:meth:`ModelStep.conclude`: a final answer validated against the output type, a retry, a
  stop);
- :class:`ToolStep`: journal the decision, then for each call: the loop detector, the driver's
  :class:`ToolGate` (refuse by workflow, check the lease before a side effect, events), and the
  executor (validate, repair, journal exactly once, run, bound the output).

Neither calls back into its driver: a step finishes its :class:`StepRecord` into the run, the
driver reads the finished ones (:meth:`LoopRun.take_finished`) and does its own bookkeeping
(checkpoint, trace) between steps. The drivers are :class:`~keel.runtime.ToolLoop` (standalone,
with :class:`~keel.runtime.LoopHooks`) and the agent's :class:`~keel.runtime._turn.TurnRunner`.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias, TypeVar, overload

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_serializer
from pydantic_core import to_jsonable_python

from keel.context import runtime_note
from keel.errors import (
    KeelError,
    MalformedResponseError,
    ModelError,
    ModelTimeoutError,
    StepLimitError,
    StoreError,
    TimeLimitError,
    ToolError,
)
from keel.guards import (
    GuardConfig,
    LoopDetector,
    LoopSignal,
    SpiralMonitor,
    SpiralSnapshot,
    check_response,
    validate_structured,
)
from keel.messages import Message, ToolCall, Usage
from keel.models import ChatModel, Completion, ModelOptions
from keel.tools import ToolExecutor, ToolJournal, ToolRegistry, ToolResult, ToolScope

logger = logging.getLogger("keel.runtime")

__all__ = [
    "LoopResult",
    "LoopRun",
    "LoopStatus",
    "LoopStop",
    "ModelOutcome",
    "ModelStep",
    "StepRecord",
    "ToolGate",
    "ToolStep",
    "call_hook",
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
]
"""How a run ended. Only ``completed`` is a real answer; every other status carries an error."""

StepAction = Literal["tool_calls", "final", "continued", "retry", "stopped"]

T = TypeVar("T")
MaybeAwaitable: TypeAlias = T | Awaitable[T]

_CONTINUE = (
    "Your previous reply was cut off at the token limit. Continue it exactly where it stopped, "
    "mid-word if it stopped mid-word: do not repeat what you wrote, do not start over, and do "
    "not mention the cut."
)
"""What the model is told when its answer was cut at the token limit (keel's words, dropped
from the history when the turn ends: the parts become one answer)."""

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
        default=None, description="Wall time of the model call (None if replayed or failed)."
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


class _History(Sequence[Message]):
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


@dataclass(frozen=True)
class ToolGate:
    """What a tool step asks its driver, each optional and sync or async.

    Attributes:
        refuse: ``(call) -> reason | None`` before a call is validated, journalled or run.
        before_side_effect: ``(call) -> None`` right before a side-effecting call is claimed;
            raise to stop the run before the effect.
        on_start: ``(step, call, arguments) -> None`` right before a validated call runs.
        on_result: ``(step, result) -> None`` as each call ends.
        fingerprint: ``() -> str``, a digest of the driver's state, for progress.
    """

    refuse: Callable[[ToolCall], MaybeAwaitable[str | None]] | None = None
    before_side_effect: Callable[[ToolCall], MaybeAwaitable[None]] | None = None
    on_start: Callable[[int, ToolCall, dict[str, Any]], None] | None = None
    on_result: Callable[[int, ToolResult], MaybeAwaitable[None]] | None = None
    fingerprint: Callable[[], MaybeAwaitable[str]] | None = None


@dataclass
class LoopRun:
    """The state of one run: its history, its steps, and what the guards count."""

    session_id: str
    turn_id: str | None
    history: _History
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
    """Finished steps the driver has taken (see :meth:`take_finished`)."""
    agent: str | None = None

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
        """The result of a run that :meth:`halt` ended at ``stop`` (``reverted``: the driver
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


class ModelStep:
    """The model's half of a step (see the module docstring).

    Args:
        model: the chat model.
        journal: where a resumed run finds the decision of its first step.
        guards: the model's timeout and failure cap, the output retries.
        monitor: the death-spiral monitor each model call is recorded in.
        agent: the agent's name, for the monitor.
        output_schema: the type a final answer must be (None: text).
        options: generation options (``timeout_s`` defaults to the guards' model timeout);
            the model is asked for cut answers (``allow_truncated``), which this step
            continues or ends.
    """

    def __init__(
        self,
        model: ChatModel,
        journal: ToolJournal,
        *,
        guards: GuardConfig,
        monitor: SpiralMonitor,
        agent: str | None = None,
        output_schema: type[Any] | None = None,
        options: ModelOptions | None = None,
    ) -> None:
        self.model = model
        self.journal = journal
        self.guards = guards
        self.monitor = monitor
        self.agent = agent
        self.output_schema = output_schema
        base = options or ModelOptions()
        if base.timeout_s is None:
            base = base.model_copy(update={"timeout_s": guards.model_timeout_s})
        # A cut answer is this loop's to continue, not an error to retry from scratch.
        self.options = base.model_copy(update={"allow_truncated": True})

    def start(
        self,
        messages: Sequence[Message],
        *,
        session_id: str,
        first_step: int,
        turn_id: str | None,
        tools: list[dict[str, Any]],
    ) -> LoopRun:
        """A run from ``messages`` (not copied: see :class:`History`)."""
        return LoopRun(
            session_id=session_id,
            turn_id=turn_id,
            history=_History(messages),
            started=time.perf_counter(),
            detector=LoopDetector(self.guards),
            tools=tools,
            model=self.model.spec,
            output_schema=self.output_schema,
            monitor=self.monitor,
            agent=self.agent,
            step=first_step,
        )

    async def replay(self, run: LoopRun) -> ModelOutcome | None:
        """The decision journalled for the run's first step, if a run before it recorded one."""
        # Only a run's first step can find a decision journalled before it: a run resumes at
        # the step of its last checkpoint, and a later step is decided by this run (a
        # concurrent writer's decision still wins, when ours is recorded).
        if run.steps:
            return None
        try:
            decision = await self.journal.adecision(_decision_scope(run), run.step)
        except StoreError:
            # Replay is an optimisation of resume; each side-effecting call is still
            # claimed in the journal before it runs, and refused if that claim cannot be
            # written.
            logger.exception("could not read the journalled decision of step %s", run.step)
            return None
        if decision is None:
            return None
        kind: Literal["tool_calls", "final"] = "tool_calls" if decision.tool_calls else "final"
        return ModelOutcome(kind, None, decision, replayed=True)

    async def ask(
        self,
        run: LoopRun,
        sent: list[Message],
        options: ModelOptions,
        on_text: Callable[[int, str], MaybeAwaitable[None]] | None = None,
    ) -> ModelOutcome:
        """Call the model with ``sent`` (its text streamed to ``on_text`` when given); an
        unusable reply or a failed call is a finished retry step."""
        assert run.current is not None
        run.current["prompt_messages"] = len(sent)
        # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow the run's own
        # cancellation when the call finishes at the same moment, and the run overruns.
        try:
            async with asyncio.timeout(self.guards.model_timeout_s) as deadline:
                completion = await self._call_model(run, sent, options, on_text)
        except TimeoutError as exc:
            reason = (
                f"no answer within {self.guards.model_timeout_s:g} s"
                if deadline.expired()
                else f"the model call timed out: {exc}"
            )
            return self._failure(run, ModelTimeoutError(reason, model=self.model.spec))
        except ModelError as exc:
            return self._failure(run, exc)
        except Exception as exc:
            # A custom ChatModel that raises something else (a bug, a KeyError): a model
            # failure like any other, never an exception out of the run.
            wrapped = ModelError(
                f"the model raised {type(exc).__name__}: {exc}", model=self.model.spec
            )
            wrapped.__cause__ = exc
            return self._failure(run, wrapped)
        run.usage = run.usage + completion.usage
        self.monitor.record_call(
            session_id=run.session_id,
            agent=self.agent,
            prompt_tokens=completion.usage.prompt_tokens,
            retry=run.retrying,
            ttft_ms=completion.ttft_ms,
        )
        if _cut_at_limit(completion):
            if not self.options.continue_truncated:
                return ModelOutcome("cut", completion, completion.message)
            return self._continue_cut(run, completion)
        return self._checked(run, _whole_answer(run, completion))

    def _checked(self, run: LoopRun, completion: Completion) -> ModelOutcome:
        """A complete reply: its calls or answer, or, unusable, a retry with a correction."""
        problem = check_response(completion)
        if problem is not None:
            error = problem.error(self.model.spec)
            run.errors.append(str(error))
            run.last_failure = error
            run.retrying = True
            run.history.append(
                Message.user(problem.correction(), metadata={"keel_correction": problem.kind})
            )
            run.finish(
                "retry",
                completion,
                completion.message,
                error=error,
                events=(f"unusable reply: {problem.detail}",),
            )
            return ModelOutcome("retry", completion, completion.message)
        run.retrying = False
        message = completion.message
        return ModelOutcome("tool_calls" if message.tool_calls else "final", completion, message)

    async def _call_model(
        self,
        run: LoopRun,
        sent: list[Message],
        options: ModelOptions,
        on_text: Callable[[int, str], MaybeAwaitable[None]] | None,
    ) -> Completion:
        """One model call: streamed to ``on_text`` when it is set."""
        if on_text is None:
            return await self.model.acomplete(sent, run.tools, options)
        completion: Completion | None = None
        stream = self.model.astream(sent, run.tools, options)
        try:
            async for chunk in stream:
                if chunk.text:
                    await call_hook(on_text, run.step, chunk.text)
                if chunk.completion is not None:
                    completion = chunk.completion
        finally:
            # Stopped early (a timeout, a cancelled turn): the provider's request ends now.
            close = getattr(stream, "aclose", None)
            if close is not None:
                await close()
        if completion is None:
            raise ModelError("the stream ended without a complete answer", model=self.model.spec)
        return completion

    def _continue_cut(self, run: LoopRun, completion: Completion) -> ModelOutcome:
        """A text answer cut at the token limit: kept as written, and the next step asks the
        model to go on from where it stopped (the parts become one answer when it ends)."""
        part = completion.message
        run.cut_parts.append(part.content)
        run.retrying = False
        run.history.append(part)
        # keel's request, in keel's name (not the user's): a correction, gone when the turn ends.
        run.history.append(
            runtime_note(_CONTINUE, reason="continue", metadata={"keel_correction": "continue"})
        )
        run.finish("continued", completion, part)
        return ModelOutcome("continued", completion, part)

    def _failure(self, run: LoopRun, error: ModelError) -> ModelOutcome:
        run.errors.append(f"{type(error).__name__}: {error}")
        run.retrying = True
        run.last_failure = error
        # A reply cut off mid-way still cost tokens and said something: trace both.
        raw = getattr(error, "raw", None)
        partial = raw if isinstance(raw, Completion) else None
        if partial is not None:
            run.usage = run.usage + partial.usage
        self.monitor.record_call(
            session_id=run.session_id,
            agent=self.agent,
            retry=True,
            prompt_tokens=partial.usage.prompt_tokens if partial is not None else 0,
        )
        run.finish("retry", partial, partial.message if partial is not None else None, error=error)
        return ModelOutcome("retry", partial, Message.assistant(""))

    def conclude(self, run: LoopRun, outcome: ModelOutcome) -> LoopResult | None:
        """What a step without tool calls means for the run: its result, or None to go on.

        Raises:
            LoopStop: the model kept failing, or the answer cannot be of the output type.
        """
        if outcome.kind == "continued":
            run.failures_in_a_row = 0
            return None
        if outcome.kind == "cut":
            return self._end_cut(run, outcome)
        if outcome.kind == "retry":
            run.failures_in_a_row += 1
            if run.failures_in_a_row >= self.guards.max_model_failures:
                last = run.last_failure or ModelError("the model kept failing")
                raise LoopStop("model_failed", last)
            return None
        run.failures_in_a_row = 0
        return self._answer(run, outcome.completion, outcome.message)

    def _answer(
        self, run: LoopRun, completion: Completion | None, message: Message
    ) -> LoopResult | None:
        """A final answer: the result, or (not of the output type) a retry with each wrong
        field, while retries are left."""
        output: Any = None
        schema = self.output_schema
        if schema is not None:
            checked = validate_structured(message.content, schema)
            if not checked.ok:
                problem = "; ".join(checked.problems)
                run.errors.append(f"structured output invalid: {problem}")
                if run.output_retries >= self.guards.max_output_retries:
                    error = MalformedResponseError(
                        f"the answer does not match {schema.__name__}: {problem}",
                        model=self.model.spec,
                        raw=message.content,
                    )
                    run.finish("stopped", completion, message, error=error, events=(problem,))
                    raise LoopStop("invalid_output", error)
                run.output_retries += 1
                run.history.append(message)
                run.history.append(
                    Message.user(
                        checked.correction(schema), metadata={"keel_correction": "structured"}
                    )
                )
                events = (f"structured output: {problem}",)
                run.finish("retry", completion, message, events=events)
                return None
            output = checked.value
        run.history.append(message)
        run.finish("final", completion, message)
        return run.result("completed", message, output=output)

    def _end_cut(self, run: LoopRun, outcome: ModelOutcome) -> LoopResult:
        """The caller's ``max_tokens`` caps the whole answer (``continue_truncated`` off): the
        answer is what was written, reported cut."""
        why = "the answer was cut at the caller's max_tokens"
        part = outcome.message
        if self.output_schema is not None:
            error = MalformedResponseError(why, model=self.model.spec)
            run.finish("stopped", outcome.completion, part, error=error)
            raise LoopStop("invalid_output", error)
        # The step is final (its streamed text stands) before the part joins any earlier ones.
        run.finish("final", outcome.completion, part, events=(why,))
        run.cut_parts.append(part.content)
        answer = Message.assistant("".join(run.cut_parts))
        run.errors.append(why)
        run.history.append(answer)
        return run.result("completed", answer, truncated=True)


class ToolStep:
    """The tools' half of a step (see the module docstring).

    Args:
        registry: the tools the model may call.
        journal: the exactly-once journal (each side-effecting call is claimed in it).
        guards: the tool timeout, output bound and retry cap.
        redact: masks what is journalled: each call's arguments and result, and the step's
            decision (None: journalled as they are).
        scope: what each call's :class:`~keel.tools.ToolContext` carries.
    """

    def __init__(
        self,
        registry: ToolRegistry,
        journal: ToolJournal | None,
        *,
        guards: GuardConfig,
        redact: Callable[[str], str] | None = None,
        scope: ToolScope | None = None,
    ) -> None:
        self.registry = registry
        self.guards = guards
        self.redact = redact
        self.executor = ToolExecutor(
            registry,
            journal=journal,
            timeout_s=guards.tool_timeout_s,
            max_output_chars=guards.max_output_chars,
            redact=redact,
            scope=scope,
        )
        self.journal = self.executor.journal

    async def __call__(self, run: LoopRun, outcome: ModelOutcome, gate: ToolGate) -> None:
        """Carry out the calls of ``outcome`` (journalled first when one has side effects).

        Raises:
            LoopStop: a loop, a call in doubt, a tool that kept failing (the step finished).
        """
        message = outcome.message
        if not outcome.replayed and any(
            (found := self.registry.get(call.name)) is not None and found.side_effect
            for call in message.tool_calls
        ):
            try:
                message = await self._record_decision(_decision_scope(run), run.step, message)
            except StoreError:
                logger.exception("could not journal the decision of step %s", run.step)
        run.history.append(message)
        calls = _Calls(run, outcome.completion, message, outcome.replayed)
        for index, call in enumerate(message.tool_calls):
            await self._run_call(calls, index, call, gate)
        fingerprint: str | None = None
        run.outcomes.update((r.tool, r.raw_arguments, r.content) for r in calls.results)
        if gate.fingerprint is not None:
            fingerprint = await call_hook(gate.fingerprint)
            # Progress is the state moving OR a call never seen before with a result never
            # seen before: an agent without a workflow calling twelve different tools is
            # working, not looping (repeats are the loop detector's business).
            calls.signal(run.detector.check_progress(f"{fingerprint}|{len(run.outcomes)}"))
        # keel's advice, marked as keel's: summaries and memory leave it out.
        run.history.extend(runtime_note(note, reason="loop") for note in calls.notes)
        calls.finish("tool_calls", fingerprint=fingerprint)
        run.failures_in_a_row = 0

    async def _run_call(self, calls: _Calls, index: int, call: ToolCall, gate: ToolGate) -> None:
        run = calls.run
        signal = run.detector.check_call(call.name, call.arguments)
        if signal is not None:
            calls.signal(signal)
            blocked = _blocked(call, "Not executed: this repeats earlier calls without progress.")
            calls.add(blocked)
            await call_hook(gate.on_result, run.step, blocked)
            return
        refusal = await call_hook(gate.refuse, call)
        if refusal is not None:
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
                await call_hook(gate.before_side_effect, call)
            on_start = gate.on_start
            result = await self.executor.execute(
                call,
                session_id=run.session_id,
                step=run.step,
                call_index=index,
                turn_id=run.turn_id,
                on_start=None if on_start is None else functools.partial(on_start, run.step, call),
            )
        calls.add(result)
        await call_hook(gate.on_result, run.step, result)
        self._count(calls, call, result)

    def _count(self, calls: _Calls, call: ToolCall, result: ToolResult) -> None:
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
            masked = _masked_message(message, self.redact)
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


class _Calls:
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
            self.add(_blocked(call, "Not executed: the run was stopped."))
        self.finish("stopped", error=error)
        raise LoopStop(status, error, detail)


def _whole_answer(run: LoopRun, completion: Completion) -> Completion:
    """``completion`` as the whole answer: after the parts of it the token limit cut, when it
    is the last part of a continued answer (checked, and used, as the whole)."""
    if not run.cut_parts:
        return completion
    whole = "".join(run.cut_parts) + completion.message.content
    run.cut_parts.clear()
    message = completion.message.model_copy(update={"content": whole})
    return completion.model_copy(update={"message": message})


def _cut_at_limit(completion: Completion) -> bool:
    """Whether ``completion`` is a text answer the token limit cut (one to continue; a cut tool
    call is not continued: its arguments are asked for again)."""
    message = completion.message
    return (
        completion.finish_reason == "length"
        and not message.tool_calls
        and bool(message.content.strip())
    )


def _decision_scope(run: LoopRun) -> str:
    """Where a step's decision is journalled: per session, and per turn when one is given."""
    return run.session_id if run.turn_id is None else f"{run.session_id}#{run.turn_id}"


def _blocked(call: ToolCall, text: str) -> ToolResult:
    return ToolResult(
        call_id=call.id,
        tool=call.name,
        status="blocked",
        content=text,
        raw_arguments=call.arguments,
    )


def _masked_message(message: Message, redact: Callable[[str], str]) -> Message:
    """``message`` with its text and every tool call's arguments masked."""
    calls = tuple(
        call.model_copy(update={"arguments": redact(call.arguments)}) for call in message.tool_calls
    )
    return message.model_copy(update={"content": redact(message.content), "tool_calls": calls})


def _close_open_calls(history: _History) -> None:
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
