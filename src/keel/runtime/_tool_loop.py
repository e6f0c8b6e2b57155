"""The inner agent loop: model -> validate -> tools -> results -> model, until it ends.

[`ToolLoop`][] owns everything between "here is the conversation" and "here is the answer":
per-call model timeouts, response validation, tool execution (validated, repaired, journalled),
loop detection, retry caps, step and wall-clock limits. A run always ends, and it ends with a
[`LoopResult`][]: a clean final message for the user, every step as a trace needs it, and the
typed error when the run could not finish.

It knows nothing of state, memory or context: a caller plugs those in through
[`LoopHooks`][] (compile the prompt and checkpoint before each model call, trace after each
step, fingerprint the state, revert it when a limit is hit). It is a thin driver over the
loop's steps (`keel.runtime._loop_run`); the agent's turn drives the same steps itself,
without hooks (`TurnRunner`):

```python
from keel.runtime import LoopHooks, ToolLoop
from keel.stores import Backends

journal = Backends.open(settings, only=("journal",)).journal
loop = ToolLoop(
    model,
    [search_flights, book_flight],              # @tool functions, or a ToolRegistry
    guards=GuardConfig(max_steps=12, run_timeout_s=60),
    journal=journal,
    hooks=LoopHooks(before_model_call=checkpoint, revert_to_last_good=revert),
)
result = await loop.arun(messages, session_id="user-42", first_step=next_step)
reply = result.text                             # always a clean message for the user
result.raise_for_status()                       # or inspect result.status / result.error
```

A tool that waits for a person (``@tool(approval=...)``) goes through the same approval hold
as in an agent's turn, never around it. Without ``approvals=`` its calls are refused (the
model is told it needs a person's approval and that there is no queue; the tool never runs).
With ``approvals=Approvals(store)`` the call waits in the store (by session) and the run ends
``awaiting_approval``; once decided, run the same step again (``first_step`` the held step,
the same ``turn_id``): the journalled decision of a side-effecting tool is replayed, the hold
finds the request decided and carries it out, once, with exactly the approved arguments.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from keel._bridge import run_sync
from keel.errors import GuardError
from keel.guards import GuardConfig, SpiralMonitor
from keel.messages import Message, ToolCall
from keel.models import ChatModel, ModelOptions
from keel.runtime._approvals import Approvals, TurnFacts
from keel.runtime._loop_run import (
    LoopResult,
    LoopRun,
    LoopStatus,
    LoopStop,
    MaybeAwaitable,
    StepRecord,
    call_hook,
    time_limit,
)
from keel.runtime._model_step import ModelStep
from keel.runtime._tool_step import ToolStep
from keel.tools import InMemoryJournal, Tool, ToolJournal, ToolRegistry, ToolResult, ToolScope

__all__ = ["LoopHooks", "LoopResult", "LoopStatus", "StepRecord", "ToolLoop"]


@dataclass
class LoopHooks:
    """Callables a caller plugs into a [`ToolLoop`][]; each may be sync or async.

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


class ToolLoop:
    """Runs the model-and-tools loop for one request, bounded by guards.

    Args:
        model: the chat model.
        tools: the tools the model may call: a registry, or tools and typed functions.
        guards: limits and thresholds (defaults: the seed values).
        journal: exactly-once journal for side-effecting tools (default: in memory; pass a
            ``SQLToolJournal`` or ``SQLToolJournal`` for crash safety).
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
            [`ToolExecutor`][keel.tools.ToolExecutor]) and each step's decision (its text and tool
            call arguments), e.g. a [`PIIMasker`][] or the agent's masking
            function. A resumed run replays the masked decision and the masked results.
            ``None`` (the default) journals them as they are. Only the journal is masked
            here: the messages of the run are the caller's to mask.
        tool_scope: the user, tenant, run id and dependencies each tool call's
            [`ToolContext`][] carries (and an approval request names).
        approvals: where calls that wait for a person wait (see the module docstring). None
            (the default): such calls are refused, not run.
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
        approvals: Approvals | None = None,
    ) -> None:
        self.model = model
        self.registry = tools if isinstance(tools, ToolRegistry) else ToolRegistry(tools)
        self.guards = guards or GuardConfig()
        self.hooks = hooks or LoopHooks()
        self.monitor = monitor or SpiralMonitor()
        self.agent = agent
        self.output_schema = output_schema
        self.redact = redact
        self.approvals = approvals
        self.tool_scope = tool_scope or ToolScope()
        self.journal = journal if journal is not None else InMemoryJournal()
        self.model_step = ModelStep(
            model,
            self.journal,
            guards=self.guards,
            monitor=self.monitor,
            agent=agent,
            output_schema=output_schema,
            options=options,
        )
        self.options = self.model_step.options

    def run(
        self,
        messages: Sequence[Message],
        *,
        session_id: str,
        first_step: int = 0,
        turn_id: str | None = None,
    ) -> LoopResult:
        """Sync twin of [`arun`][] (not for use inside a running event loop)."""
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
        run = self.model_step.start(
            messages,
            session_id=session_id,
            first_step=first_step,
            turn_id=turn_id,
            tools=self.registry.schemas(),
        )
        tools = self._tool_step(session_id, turn_id)
        try:
            async with asyncio.timeout(self.guards.run_timeout_s):
                result = await self._drive(run, tools)
        except TimeoutError:
            result = await self._end(run, time_limit(self.guards))
        if result.error is not None and self.guards.fallback == "raise":
            raise result.error
        return result

    def _tool_step(self, session_id: str, turn_id: str | None = None) -> ToolStep:
        """The tool step of one run on ``session_id``: its approval hold holds that run's
        calls (a run's facts are its own, so one loop serves many sessions)."""
        scope = self.tool_scope
        facts = TurnFacts(
            key=session_id,
            session_id=session_id,
            user_id=scope.user_id or "",
            tenant_id=scope.tenant_id or "default",
            turn_id=turn_id,
            mask=None if self.redact is None else _awaitable(self.redact),
            before_side_effect=self.hooks.before_side_effect,
        )
        return ToolStep(
            self.registry,
            self.journal,
            guards=self.guards,
            redact=self.redact,
            scope=scope,
            facts=facts,
            approvals=self.approvals,
            refuse=self.hooks.refuse_call,
            events=_HookEvents(self.hooks),
        )

    # --- driving the steps ------------------------------------------------------------------

    async def _drive(self, run: LoopRun, tools: ToolStep) -> LoopResult:
        """Step until an answer or a stop, the hooks around each step."""
        hooks, model_step = self.hooks, self.model_step
        try:
            while True:
                run.begin(self.guards)
                prompt = await call_hook(hooks.before_model_call, run.step, run.history)
                sent = list(prompt) if prompt is not None else list(run.history)
                outcome = await model_step.replay(run)
                if outcome is None:
                    options = model_step.options
                    if hooks.model_options is not None:
                        options = await call_hook(hooks.model_options, run.step, options)
                    outcome = await model_step.ask(run, sent, options, hooks.on_text)
                await self._after_steps(run)
                if outcome.kind == "tool_calls":
                    calls = await tools(run, outcome)
                    fingerprint = await call_hook(hooks.state_fingerprint)
                    tools.finish(calls, fingerprint)
                    await self._after_steps(run)
                    if tools.hold.parked:
                        return tools.hold.park(run)
                elif (result := model_step.conclude(run, outcome)) is not None:
                    await self._after_steps(run)
                    return result
                else:
                    await self._after_steps(run)
        except LoopStop as stop:
            return await self._end(run, stop)

    async def _after_steps(self, run: LoopRun) -> None:
        for record in run.take_finished():
            await call_hook(self.hooks.after_step, record)

    async def _end(self, run: LoopRun, stop: LoopStop) -> LoopResult:
        """The run stops: its last step traced, the state reverted when a guard stopped it."""
        ended = run.halt(stop)
        await self._after_steps(run)
        if isinstance(ended, LoopResult):
            return ended
        reverted = False
        if isinstance(ended.error, GuardError) and self.hooks.revert_to_last_good is not None:
            await call_hook(self.hooks.revert_to_last_good, ended.error)
            reverted = True
        return run.stopped(ended, reverted=reverted)


class _HookEvents:
    """A loop's tool hooks as its tool step's event sink."""

    def __init__(self, hooks: LoopHooks) -> None:
        self.hooks = hooks

    def on_tool_start(self, step: int, call: ToolCall, arguments: dict[str, Any]) -> None:
        if self.hooks.on_tool_start is not None:
            self.hooks.on_tool_start(step, call, arguments)

    def on_tool_result(self, step: int, result: ToolResult) -> MaybeAwaitable[None]:
        if self.hooks.on_tool_result is None:
            return None
        return self.hooks.on_tool_result(step, result)


def _awaitable(redact: Callable[[str], str]) -> Callable[[str], Awaitable[str]]:
    """``redact`` as the approval hold calls it (a loop's redaction is the caller's own,
    blocking or not: its masking writes nothing to a vault)."""

    async def masked(text: str) -> str:
        return redact(text)

    return masked
