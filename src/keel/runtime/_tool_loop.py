"""The inner agent loop: model -> validate -> tools -> results -> model, until it ends.

:class:`ToolLoop` owns everything between "here is the conversation" and "here is the answer":
per-call model timeouts, response validation, tool execution (validated, repaired, journalled),
loop detection, retry caps, step and wall-clock limits. A run always ends, and it ends with a
:class:`LoopResult`: a clean final message for the user, every step as a trace needs it, and the
typed error when the run could not finish.

It knows nothing of state, memory or context: the agent plugs those in through
:class:`LoopHooks` (compile the prompt and checkpoint before each model call, trace after each
step, fingerprint the state, revert it when a limit is hit)::

    from keel.runtime import LoopHooks, ToolLoop
    from keel.stores import SQLiteDatabase, SQLiteToolJournal

    loop = ToolLoop(
        model,
        [search_flights, book_flight],              # @tool functions, or a ToolRegistry
        guards=GuardConfig(max_steps=12, run_timeout_s=60),
        journal=SQLiteToolJournal(SQLiteDatabase("keel.db")),
        hooks=LoopHooks(before_model_call=checkpoint, revert_to_last_good=revert),
    )
    result = await loop.arun(messages, session_id="user-42", first_step=next_step)
    reply = result.text                             # always a clean message for the user
    result.raise_for_status()                       # or inspect result.status / result.error
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

from keel._bridge import run_sync
from keel.context import runtime_note
from keel.errors import (
    GuardError,
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
from keel.tools import Tool, ToolExecutor, ToolJournal, ToolRegistry, ToolResult, ToolScope

logger = logging.getLogger("keel.runtime")

__all__ = ["LoopHooks", "LoopResult", "LoopStatus", "StepRecord", "ToolLoop"]

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


@dataclass
class LoopHooks:
    """Callables the agent plugs into the loop; each may be sync or async.

    Attributes:
        before_model_call: ``(step, messages) -> messages | None``, called before every model
            call (checkpoint here). ``messages`` is the run's conversation so far, a read-only
            sequence that is not copied (slicing it past the run's start costs what the run
            added). Return the prompt to send (a compiled context), or None to send the loop's
            history as is.
        after_step: ``(step_record) -> None``, called after every step (trace here).
        state_fingerprint: ``() -> str``, a digest of the state; unchanged for
            ``max_steps_without_progress`` steps counts as a loop.
        revert_to_last_good: ``(error) -> None``, called once when a guard stops the run (step
            limit, time limit, loop): restore the last good checkpoint.
        before_side_effect: ``(call) -> None``, called right before a side-effecting tool is
            claimed in the journal and run. Raise (a ``ConflictError``, say) to stop the run
            before the effect: the agent checks here that it still owns the session.
        refuse_call: ``(call) -> str | None``, asked before each call is validated, journalled
            or run: a reason refuses it (the model is told why; nothing is claimed in the
            journal, nothing runs), None lets it through. The agent gates tools by workflow
            state here.
        on_text: ``(step, text) -> None``: more characters of the model's reply, as they are
            generated. Set, the loop streams its model calls (``ChatModel.astream``); the reply
            is checked only once it is complete, as an unstreamed one is.
        on_tool_start: ``(step, call, arguments) -> None``, right before a validated call runs.
        on_tool_result: ``(step, result) -> None``, as each call of a step ends.
        model_options: ``(step, options) -> options``, right after ``before_model_call``: the
            generation options of this step's model call (the agent sizes ``max_tokens`` to
            the room its compiled prompt left in the window).
    """

    before_model_call: (
        Callable[[int, Sequence[Message]], MaybeAwaitable[Sequence[Message] | None]] | None
    ) = None
    after_step: Callable[[StepRecord], MaybeAwaitable[None]] | None = None
    state_fingerprint: Callable[[], MaybeAwaitable[str]] | None = None
    revert_to_last_good: Callable[[GuardError], MaybeAwaitable[None]] | None = None
    before_side_effect: Callable[[ToolCall], MaybeAwaitable[None]] | None = None
    refuse_call: Callable[[ToolCall], MaybeAwaitable[str | None]] | None = None
    on_text: Callable[[int, str], MaybeAwaitable[None]] | None = None
    on_tool_start: Callable[[int, ToolCall, dict[str, Any]], None] | None = None
    on_tool_result: Callable[[int, ToolResult], MaybeAwaitable[None]] | None = None
    model_options: Callable[[int, ModelOptions], MaybeAwaitable[ModelOptions]] | None = None


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


@dataclass
class _Run:
    session_id: str
    turn_id: str | None
    history: _History
    start_len: int
    started: float
    started_wall: float
    detector: LoopDetector
    tools: list[dict[str, Any]]
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


class _Stop(Exception):
    def __init__(self, status: LoopStatus, error: KeelError, detail: str = "") -> None:
        self.status = status
        self.error = error
        self.detail = detail
        super().__init__(str(error))


class ToolLoop:
    """Runs the model-and-tools loop for one request, bounded by guards.

    Args:
        model: the chat model.
        tools: the tools the model may call: a registry, or tools and typed functions.
        guards: limits and thresholds (defaults: the seed values).
        journal: exactly-once journal for side-effecting tools (default: in memory; pass a
            ``SQLiteToolJournal`` or ``PostgresToolJournal`` for crash safety).
        hooks: the agent's callables (checkpoint, trace, fingerprint, revert).
        monitor: a shared death-spiral monitor (default: one per loop).
        agent: the agent's name, for the monitor's per-agent indicators.
        output_schema: the type the final answer must be (a Pydantic model, a TypedDict...):
            the answer is one JSON object validated against it; an invalid one is sent back with
            each wrong field, up to ``guards.max_output_retries`` times.
        options: generation options for every model call (``timeout_s`` defaults to the
            guards' ``model_timeout_s``). A text answer cut at ``max_tokens`` is continued:
            the loop asks the model to go on where it stopped and joins the parts into one
            answer, within the step and time limits (the loop asks providers for cut answers,
            ``allow_truncated``, instead of an error).
        redact: masks everything the loop journals: each call's arguments and result (see
            :class:`~keel.tools.ToolExecutor`) and each step's decision (its text and tool
            call arguments), e.g. a :class:`~keel.privacy.PIIMasker` or the agent's masking
            function. A resumed run replays the masked decision and the masked results.
            ``None`` (the default) journals them as they are. Only the journal is masked
            here: the messages of the run are the caller's to mask.
        tool_scope: the user, tenant, run id and dependencies each tool call's
            :class:`~keel.tools.ToolContext` carries.
    """

    def __init__(
        self,
        model: ChatModel,
        tools: ToolRegistry | Iterable[Tool | Callable[..., Any]] = (),
        *,
        guards: GuardConfig | None = None,
        journal: ToolJournal | None = None,
        hooks: LoopHooks | None = None,
        monitor: SpiralMonitor | None = None,
        agent: str | None = None,
        output_schema: type[Any] | None = None,
        options: ModelOptions | None = None,
        redact: Callable[[str], str] | None = None,
        tool_scope: ToolScope | None = None,
    ) -> None:
        self.model = model
        self.registry = tools if isinstance(tools, ToolRegistry) else ToolRegistry(tools)
        self.guards = guards or GuardConfig()
        self.hooks = hooks or LoopHooks()
        self.monitor = monitor or SpiralMonitor()
        self.agent = agent
        self.output_schema = output_schema
        self.executor = ToolExecutor(
            self.registry,
            journal=journal,
            timeout_s=self.guards.tool_timeout_s,
            max_output_chars=self.guards.max_output_chars,
            redact=redact,
            scope=tool_scope,
        )
        self.journal = self.executor.journal
        self.redact = redact
        base = options or ModelOptions()
        if base.timeout_s is None:
            base = base.model_copy(update={"timeout_s": self.guards.model_timeout_s})
        # A cut answer is this loop's to continue, not an error to retry from scratch.
        self.options = base.model_copy(update={"allow_truncated": True})

    def run(
        self,
        messages: Sequence[Message],
        *,
        session_id: str,
        first_step: int = 0,
        turn_id: str | None = None,
    ) -> LoopResult:
        """Sync twin of :meth:`arun` (not for use inside a running event loop)."""
        return run_sync(
            self.arun(messages, session_id=session_id, first_step=first_step, turn_id=turn_id)
        )

    async def arun(
        self,
        messages: Sequence[Message],
        *,
        session_id: str,
        first_step: int = 0,
        turn_id: str | None = None,
    ) -> LoopResult:
        """Run until a final answer or a stop; always returns (unless ``fallback='raise'``).

        Args:
            messages: the conversation so far (system prompt, history, the new user message).
            session_id: the session; with the step number it keys side-effecting calls.
            first_step: the number of this run's first step. Step numbers must never repeat
                within a session; a resumed run passes the step it resumes at, and any tool
                calls journalled for that step are replayed instead of asking the model again.
            turn_id: the id of the turn this run belongs to (kept across a resume). It makes
                journal keys and recorded decisions unique to the turn, so two writers that
                reached the same step number never share an entry.

        Raises:
            KeelError: only with ``fallback='raise'``: the typed error that stopped the run.
        """
        run = _Run(
            session_id=session_id,
            turn_id=turn_id,
            history=_History(messages),
            start_len=len(messages),
            started=time.perf_counter(),
            started_wall=time.time(),
            detector=LoopDetector(self.guards),
            tools=self.registry.schemas(),
            step=first_step,
        )
        result: LoopResult
        try:
            async with asyncio.timeout(self.guards.run_timeout_s):
                result = await self._loop(run)
        except TimeoutError:
            limit = TimeLimitError(
                f"run reached its wall-clock limit of {self.guards.run_timeout_s:g} s"
            )
            if run.cut_parts:
                result = await self._cut_short(run, limit)
            else:
                result = await self._stop(run, _Stop("time_limit", limit))
        if result.error is not None and self.guards.fallback == "raise":
            raise result.error
        return result

    # --- the loop ----------------------------------------------------------------------------

    async def _loop(self, run: _Run) -> LoopResult:
        failures_in_a_row = 0
        tool_failures: dict[str, int] = {}
        output_retries = 0
        steps_taken = 0
        while True:
            if steps_taken >= self.guards.max_steps:
                limit = StepLimitError(
                    f"run reached its limit of {self.guards.max_steps} steps without an answer"
                )
                if run.cut_parts:
                    return await self._cut_short(run, limit)
                return await self._stop(run, _Stop("step_limit", limit))
            elapsed = time.perf_counter() - run.started
            if elapsed >= self.guards.run_timeout_s:
                raise TimeoutError  # the run's deadline passed between awaits
            steps_taken += 1
            run.current = {"step": run.step, "started_at": time.time(), "t0": time.perf_counter()}
            try:
                outcome = await self._step(run, tool_failures)
            except _Stop as stop:
                return await self._stop(run, stop)
            if outcome is None:
                continue
            kind, completion, message = outcome
            if kind == "continued":
                failures_in_a_row = 0
                continue
            if kind == "cut" and completion is not None:
                return await self._end_cut(run, completion, message)
            if kind == "retry":
                failures_in_a_row += 1
                if failures_in_a_row >= self.guards.max_model_failures:
                    last = run.last_failure or ModelError("the model kept failing")
                    return await self._stop(run, _Stop("model_failed", last))
                continue
            failures_in_a_row = 0
            if kind == "tool_calls":
                continue
            # A final answer.
            output: Any = None
            if self.output_schema is not None:
                checked = validate_structured(message.content, self.output_schema)
                if not checked.ok:
                    problem = "; ".join(checked.problems)
                    run.errors.append(f"structured output invalid: {problem}")
                    if output_retries >= self.guards.max_output_retries:
                        error = MalformedResponseError(
                            f"the answer does not match {self.output_schema.__name__}: {problem}",
                            model=self.model.spec,
                            raw=message.content,
                        )
                        await self._finish_step(
                            run, "stopped", completion, message, error=error, events=(problem,)
                        )
                        return await self._stop(run, _Stop("invalid_output", error))
                    output_retries += 1
                    run.history.append(message)
                    run.history.append(
                        Message.user(
                            checked.correction(self.output_schema),
                            metadata={"keel_correction": "structured"},
                        )
                    )
                    await self._finish_step(
                        run, "retry", completion, message, events=(f"structured output: {problem}",)
                    )
                    continue
                output = checked.value
            run.history.append(message)
            await self._finish_step(run, "final", completion, message)
            return self._result(run, "completed", message, output=output)

    async def _step(
        self, run: _Run, tool_failures: dict[str, int]
    ) -> tuple[str, Completion | None, Message] | None:
        """One step. Returns (kind, completion, message); raises _Stop to end the run."""
        prompt = await _call(self.hooks.before_model_call, run.step, run.history)
        sent = list(prompt) if prompt is not None else list(run.history)
        decision: Message | None = None
        # Only a run's first step can find a decision journalled before it: a run resumes at
        # the step of its last checkpoint, and a later step is decided by this run (a
        # concurrent writer's decision still wins, when ours is recorded).
        if not run.steps:
            try:
                decision = await self.journal.adecision(_decision_scope(run), run.step)
            except StoreError:
                # Replay is an optimisation of resume; each side-effecting call is still
                # claimed in the journal before it runs, and refused if that claim cannot be
                # written.
                logger.exception("could not read the journalled decision of step %s", run.step)
        completion: Completion | None = None
        if decision is not None:
            message = decision
        else:
            assert run.current is not None
            run.current["prompt_messages"] = len(sent)
            options = self.options
            if self.hooks.model_options is not None:
                options = await _call(self.hooks.model_options, run.step, options)
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow the run's own
            # cancellation when the call finishes at the same moment, and the run overruns.
            try:
                async with asyncio.timeout(self.guards.model_timeout_s) as deadline:
                    completion = await self._ask_model(run, sent, options)
            except TimeoutError as exc:
                reason = (
                    f"no answer within {self.guards.model_timeout_s:g} s"
                    if deadline.expired()
                    else f"the model call timed out: {exc}"
                )
                error: ModelError = ModelTimeoutError(reason, model=self.model.spec)
                return await self._model_failure(run, error)
            except ModelError as exc:
                return await self._model_failure(run, exc)
            except Exception as exc:
                # A custom ChatModel that raises something else (a bug, a KeyError): a model
                # failure like any other, never an exception out of the run.
                wrapped = ModelError(
                    f"the model raised {type(exc).__name__}: {exc}", model=self.model.spec
                )
                wrapped.__cause__ = exc
                return await self._model_failure(run, wrapped)
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
                    return ("cut", completion, completion.message)
                return await self._continue_cut(run, completion)
            completion = _whole_answer(run, completion)
            problem = check_response(completion)
            if problem is not None:
                error = problem.error(self.model.spec)
                run.errors.append(str(error))
                run.last_failure = error
                run.retrying = True
                run.history.append(
                    Message.user(problem.correction(), metadata={"keel_correction": problem.kind})
                )
                await self._finish_step(
                    run,
                    "retry",
                    completion,
                    completion.message,
                    error=error,
                    events=(f"unusable reply: {problem.detail}",),
                )
                return ("retry", completion, completion.message)
            run.retrying = False
            message = completion.message
        if not message.tool_calls:
            return ("final", completion, message)
        if decision is None and any(
            (found := self.registry.get(call.name)) is not None and found.side_effect
            for call in message.tool_calls
        ):
            try:
                message = await self._record_decision(_decision_scope(run), run.step, message)
            except StoreError:
                logger.exception("could not journal the decision of step %s", run.step)
        run.history.append(message)
        await self._run_calls(
            run, completion, message, tool_failures, replayed=decision is not None
        )
        return ("tool_calls", completion, message)

    async def _ask_model(self, run: _Run, sent: list[Message], options: ModelOptions) -> Completion:
        """One model call: streamed to ``on_text`` when it is set."""
        on_text = self.hooks.on_text
        if on_text is None:
            return await self.model.acomplete(sent, run.tools, options)
        completion: Completion | None = None
        stream = self.model.astream(sent, run.tools, options)
        try:
            async for chunk in stream:
                if chunk.text:
                    await _call(on_text, run.step, chunk.text)
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

    async def _continue_cut(
        self, run: _Run, completion: Completion
    ) -> tuple[str, Completion | None, Message]:
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
        await self._finish_step(run, "continued", completion, part)
        return ("continued", completion, part)

    async def _end_cut(self, run: _Run, completion: Completion, part: Message) -> LoopResult:
        """The caller's ``max_tokens`` caps the whole answer (``continue_truncated`` off): the
        answer is what was written, reported cut."""
        why = "the answer was cut at the caller's max_tokens"
        if self.output_schema is not None:
            error = MalformedResponseError(why, model=self.model.spec)
            await self._finish_step(run, "stopped", completion, part, error=error)
            return await self._stop(run, _Stop("invalid_output", error))
        # The step is final (its streamed text stands) before the part joins any earlier ones.
        await self._finish_step(run, "final", completion, part, events=(why,))
        run.cut_parts.append(part.content)
        answer = Message.assistant("".join(run.cut_parts))
        run.errors.append(why)
        run.history.append(answer)
        return self._result(run, "completed", answer, truncated=True)

    async def _cut_short(self, run: _Run, limit: GuardError) -> LoopResult:
        """The run's step or time limit came while an answer was being continued: the answer
        is what was written, reported cut (with an output type, a cut answer is not one)."""
        why = f"the answer was cut: {limit}"
        if run.current is not None:
            await self._finish_step(run, "stopped", None, None, error=limit, events=(why,))
        if self.output_schema is not None:
            error = MalformedResponseError(why, model=self.model.spec)
            return await self._stop(run, _Stop("invalid_output", error))
        run.errors.append(why)
        answer = Message.assistant("".join(run.cut_parts))
        run.history.append(answer)
        return self._result(run, "completed", answer, truncated=True)

    async def _model_failure(
        self, run: _Run, error: ModelError
    ) -> tuple[str, Completion | None, Message]:
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
        await self._finish_step(
            run, "retry", partial, partial.message if partial is not None else None, error=error
        )
        return ("retry", partial, Message.assistant(""))

    async def _run_calls(
        self,
        run: _Run,
        completion: Completion | None,
        message: Message,
        tool_failures: dict[str, int],
        *,
        replayed: bool,
    ) -> None:
        results: list[ToolResult] = []
        events: list[str] = []
        notes: list[str] = []
        calls = list(message.tool_calls)

        async def stop(status: LoopStatus, error: KeelError, detail: str = "") -> None:
            for call in calls[len(results) :]:
                blocked = _blocked(call, "Not executed: the run was stopped.")
                results.append(blocked)
                run.history.append(blocked.to_message())
            await self._finish_step(
                run,
                "stopped",
                completion,
                message,
                results=results,
                events=events,
                error=error,
                replayed=replayed,
            )
            raise _Stop(status, error, detail)

        def on_loop(signal: LoopSignal) -> None:
            run.loops += 1
            events.append(f"loop {'stop' if signal.stop else 'warning'}: {signal.kind}")
            run.errors.append("; ".join(signal.evidence))

        for index, call in enumerate(calls):
            signal = run.detector.check_call(call.name, call.arguments)
            if signal is not None:
                on_loop(signal)
                if signal.stop:
                    await stop("loop_detected", signal.error())
                blocked = _blocked(
                    call, "Not executed: this repeats earlier calls without progress."
                )
                results.append(blocked)
                run.history.append(blocked.to_message())
                await _call(self.hooks.on_tool_result, run.step, blocked)
                notes.append(signal.advice())
                continue
            refusal = await _call(self.hooks.refuse_call, call)
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
                    await _call(self.hooks.before_side_effect, call)
                on_tool_start = self.hooks.on_tool_start
                result = await self.executor.execute(
                    call,
                    session_id=run.session_id,
                    step=run.step,
                    call_index=index,
                    turn_id=run.turn_id,
                    on_start=(
                        None
                        if on_tool_start is None
                        else functools.partial(on_tool_start, run.step, call)
                    ),
                )
            results.append(result)
            run.history.append(result.to_message())
            await _call(self.hooks.on_tool_result, run.step, result)
            if result.repairs:
                run.repairs += 1
                events.append(f"repaired {call.name} arguments: {'; '.join(result.repairs)}")
            if result.status == "in_doubt":
                assert result.exception is not None
                run.errors.append(str(result.exception))
                await stop("tool_in_doubt", result.exception)
            if not result.ok:
                run.errors.append(result.error or result.status)
            key = call.name if call.name in self.registry else "<unknown tools>"
            if result.ok:
                tool_failures[key] = 0
            else:
                tool_failures[key] = tool_failures.get(key, 0) + 1
                if tool_failures[key] > self.guards.max_tool_retries:
                    error = result.exception or ToolError(result.error or result.status)
                    what = (
                        f"the tool {call.name!r} kept failing ({result.error})"
                        if key != "<unknown tools>"
                        else "I kept trying to use tools that do not exist"
                    )
                    await stop("tool_retry_limit", error, what)
            signal = run.detector.check_error(call.name, None if result.ok else result.content)
            if signal is not None:
                on_loop(signal)
                if signal.stop:
                    await stop("loop_detected", signal.error())
                notes.append(signal.advice())
        fingerprint: str | None = None
        run.outcomes.update((r.tool, r.raw_arguments, r.content) for r in results)
        if self.hooks.state_fingerprint is not None:
            fingerprint = await _call(self.hooks.state_fingerprint)
            # Progress is the state moving OR a call never seen before with a result never
            # seen before: an agent without a workflow calling twelve different tools is
            # working, not looping (repeats are the loop detector's business).
            signal = run.detector.check_progress(f"{fingerprint}|{len(run.outcomes)}")
            if signal is not None:
                on_loop(signal)
                if signal.stop:
                    await stop("loop_detected", signal.error())
                notes.append(signal.advice())
        # keel's advice, marked as keel's: summaries and memory leave it out.
        run.history.extend(runtime_note(note, reason="loop") for note in notes)
        await self._finish_step(
            run,
            "tool_calls",
            completion,
            message,
            results=results,
            events=events,
            replayed=replayed,
            fingerprint=fingerprint,
        )

    # --- bookkeeping ---------------------------------------------------------------------------

    async def _finish_step(
        self,
        run: _Run,
        action: Literal["tool_calls", "final", "continued", "retry", "stopped"],
        completion: Completion | None,
        message: Message | None,
        *,
        results: Sequence[ToolResult] = (),
        events: Sequence[str] = (),
        error: BaseException | None = None,
        replayed: bool = False,
        fingerprint: str | None = None,
    ) -> None:
        current = run.current or {"started_at": time.time(), "t0": time.perf_counter()}
        record = StepRecord(
            step=run.step,
            action=action,
            started_at=current["started_at"],
            latency_ms=(time.perf_counter() - current["t0"]) * 1000,
            model_latency_ms=completion.latency_ms if completion is not None else None,
            ttft_ms=completion.ttft_ms if completion is not None else None,
            model=completion.model if completion is not None else self.model.spec,
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
            answer_parts=len(run.cut_parts),
        )
        run.steps.append(record)
        run.current = None
        run.step += 1
        await _call(self.hooks.after_step, record)

    async def _stop(self, run: _Run, stop: _Stop) -> LoopResult:
        if run.current is not None:
            # The run was interrupted inside a step (the time limit): record what is known.
            await self._finish_step(run, "stopped", None, None, error=stop.error)
        _close_open_calls(run.history)
        run.errors.append(f"{type(stop.error).__name__}: {stop.error}")
        reverted = False
        if isinstance(stop.error, GuardError) and self.hooks.revert_to_last_good is not None:
            await _call(self.hooks.revert_to_last_good, stop.error)
            reverted = True
            self.monitor.record_state_reset(session_id=run.session_id, agent=self.agent)
        template = _USER_MESSAGES[stop.status]
        text = template.format(detail=stop.detail or str(stop.error))
        # keel's words for the user, not the model's: the run's history does not hold them, so
        # a caller that continues from ``messages`` never shows the model an apology as its own.
        final = Message.assistant(text, metadata={"keel_stop": stop.status})
        return self._result(run, stop.status, final, error=stop.error, reverted=reverted)

    def _result(
        self,
        run: _Run,
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
            new_messages=list(run.history.added),
            steps=list(run.steps),
            error=error,
            error_message=None if error is None else str(error),
            errors=list(run.errors),
            usage=run.usage,
            next_step=run.step,
            duration_ms=(time.perf_counter() - run.started) * 1000,
            reverted=reverted,
            truncated=truncated,
            loops_detected=run.loops,
            repairs=run.repairs,
            spiral=self.monitor.snapshot(session_id=run.session_id),
        )
        result._earlier = run.history.earlier
        return result


def _whole_answer(run: _Run, completion: Completion) -> Completion:
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


def _decision_scope(run: _Run) -> str:
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


async def _call(hook: Callable[..., Any] | None, *args: Any) -> Any:
    if hook is None:
        return None
    value = hook(*args)
    if inspect.isawaitable(value):
        value = await value
    return value
