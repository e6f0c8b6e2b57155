"""One turn, run by the object that owns it: `TurnRunner`.

The [`Agent`][] is configuration; what a turn needs of it is one immutable
`TurnDeps` (the model, the stores, the context engine, the guards, the privacy policy,
the workflow...). A runner is built per turn over those dependencies and the turn's own facts
(the session, the user, the checkpoint it starts from), and it owns everything that changes
while the turn runs: the state as of its last checkpoint, the session's log, the workflow's
position, the trace, the side effects that happened. It drives the turn itself: the checkpoint
before each model call, the model step and the tool step (`keel.runtime._steps`), the
trace after each step, and at the end the commit (or the revert to the last good state), the
running summary and the hand-off to memory.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypedDict

from keel.context import ContextEngine, ContextMemory
from keel.errors import ConflictError, GuardError, KeelError, StoreError, TurnInterruptedError
from keel.guards import GuardConfig, SpiralMonitor
from keel.messages import Message, ToolCall
from keel.models import ChatModel, ModelOptions
from keel.runtime._approvals import (
    ESCALATED_NOTE,
    ApprovalHold,
    Approvals,
    TurnFacts,
    pending_view,
    with_decision_tool,
)
from keel.runtime._events import AgentEvent, CheckpointCommitted
from keel.runtime._hand_off import MemoryHandOff
from keel.runtime._lease import Lease
from keel.runtime._log import SessionLog
from keel.runtime._masking import Masking
from keel.runtime._model_step import ModelStep
from keel.runtime._prompt import TurnPrompt
from keel.runtime._replies import Recent, with_reply
from keel.runtime._reply import AgentReply
from keel.runtime._steps import (
    LoopResult,
    LoopRun,
    LoopStop,
    StepRecord,
    ToolGate,
    time_limit,
)
from keel.runtime._stream import TurnStream
from keel.runtime._text import (
    cancelled_note,
    clip,
    is_user_turn,
    sanitize,
    unanswered_note,
    without_corrections,
)
from keel.runtime._tool_step import ToolStep
from keel.runtime._workflow import WORKFLOW_TOOLS, Workflow, WorkflowCursor
from keel.state import AgentState, Checkpoint, MachinePosition, StateStore
from keel.tools import ToolJournal, ToolRegistry, ToolScope
from keel.tracing import RunTrace, Tracer, arecord_loop_step

__all__ = ["RunExtras", "SessionLogs", "TurnDeps", "TurnOptions", "TurnRunner"]

logger = logging.getLogger("keel.runtime")

_FINISHED_KEPT = 20
"""Finished workflow instances a session keeps."""

_FAILURE_REPLY = (
    "I'm sorry, something went wrong on my side and nothing was changed. Please try again."
)


class SessionLogs(Recent[str, SessionLog]):
    """The sessions' logs this process keeps, by session key (least recently used go first;
    an evicted session's log is rebuilt from the store)."""

    def of(self, engine: ContextEngine, key: str, state: AgentState, version: int) -> SessionLog:
        """The session's log at ``version``: the kept one (brought up to ``version`` when
        another process only added to it), or built from ``state``."""
        cached = self.get(key)
        if cached is not None and (cached.version == version or cached.catch_up(state, version)):
            self.move_to_end(key)
            return cached
        log = SessionLog.of(engine, key, state, version)
        self[key] = log
        return log


@dataclass(frozen=True)
class TurnDeps:
    """What a turn needs of its agent: fixed for the agent's life (the log and owner caches
    are shared, as the stores are)."""

    model: ChatModel
    state: StateStore[AgentState]
    engine: ContextEngine
    monitor: SpiralMonitor
    guards: GuardConfig
    journal: ToolJournal
    tracer: Tracer
    masking: Masking
    workflow: Workflow
    system_prompt: str
    rules: tuple[str, ...]
    output_type: type[Any] | None
    model_options: ModelOptions
    tenant_id: str
    name: str
    logs: SessionLogs
    owners: Recent[str, tuple[str, str]]
    memory: MemoryHandOff | None
    recall: Callable[[str, str], Awaitable[list[ContextMemory]]]
    """The memories for (user id, query) within their budget."""
    approvals: Approvals | None = None

    def for_user(self, user_id: str) -> TurnDeps:
        """The dependencies of ``user_id``'s turns: masking numbered through their view of the
        PII vault, and a tracer that masks the same way (these very ones without a vault)."""
        current = self.masking.user_vault
        if current is not None and current.user_id == user_id:
            return self
        masking = self.masking.for_user(user_id)
        if masking is self.masking:
            return self
        return dataclasses.replace(self, masking=masking, tracer=masking.traced(self.tracer))


class TurnOptions(TypedDict, total=False):
    """The options of one ``Agent.run`` / ``Agent.stream`` call (see [`Agent.run`][])."""

    deps: Any
    output_type: type[Any] | None
    model_options: ModelOptions | None
    turn_id: str | None
    on_cancel: OnCancel


OnCancel = Literal["keep_open", "close"]
"""What a cancelled turn leaves: ``keep_open`` (the default) keeps it open at its last
checkpoint for the session's next turn (or ``resume``) to finish, as after a crash; ``close``
ends it there, as a person at a terminal means Ctrl-C: the history keeps the user's message,
the side effects that happened and keel's note that the user cancelled the answer, and the next
message is answered on its own."""


@dataclass(frozen=True)
class RunExtras:
    """What one ``run`` / ``stream`` call sets for its turn only."""

    deps: Any = None
    output_type: type[Any] | None = None
    model_options: ModelOptions | None = None
    turn_id: str | None = None
    on_cancel: OnCancel = "keep_open"
    reveal: bool = True
    """Whether the reply shows the user's values (their placeholders revealed, as the user
    reads it); False: the reply as the turn stored it, placeholders, for a caller who may not
    read the user's values (an operator deciding one of the turn's calls)."""


@dataclass(frozen=True)
class _Start:
    """Where a turn starts: its id, its user message and that message's place in the log."""

    turn_id: str
    user_message: Message
    turn_start: int
    state: AgentState
    written: int


class TurnRunner:
    """Runs one turn on a session the caller holds the lease of (see the module docstring).

    Args:
        deps: the agent's dependencies.
        lease: the caller's lease on the session (renewed before each side effect).
        key / session_id / user_id: the session's store key, its id, and the user.
        checkpoint: the session's state as loaded.
        text: the user's message; None finishes the turn a crash left open.
        emit: where a streamed turn's events go (None: not streamed).
        extras: the call's own options.
    """

    def __init__(
        self,
        deps: TurnDeps,
        lease: Lease,
        key: str,
        session_id: str,
        user_id: str,
        checkpoint: Checkpoint[AgentState],
        text: str | None,
        emit: Callable[[AgentEvent], None] | None = None,
        extras: RunExtras | None = None,
    ) -> None:
        extras = extras or RunExtras()
        self.deps = deps
        self.lease = lease
        self.key = key
        self.session_id = session_id
        self.user_id = user_id
        self.resume = text is None
        self.started = time.monotonic()
        self.deadline = self.started + deps.guards.run_timeout_s
        self.version = checkpoint.version
        self.log = deps.logs.of(deps.engine, key, checkpoint.state, checkpoint.version)
        self.emit = emit
        self.stream = TurnStream(emit, deps.masking) if emit is not None else None
        self.tool_deps = extras.deps
        self.output_type = extras.output_type or deps.output_type
        self.reveal = extras.reveal
        self.on_cancel = extras.on_cancel
        self.cursor = WorkflowCursor(checkpoint.state.machine, emit=emit)
        start = self._start(checkpoint.state, text, extras.turn_id)
        self.turn_id = start.turn_id
        self.user_message = start.user_message
        self.turn_start = start.turn_start
        """Index of the turn's user message in the state's messages."""
        self.state = start.state
        """The turn's state as of its last checkpoint, except ``messages``: while the turn
        appends to the log, that is the log itself (see ``written``)."""
        self.written = start.written
        """Messages of the log the checkpoint at ``version`` holds: the rest are the next
        append."""
        self.record_reply = bool(self.user_message.metadata.get("client_turn"))
        """The caller gave the turn its id: its reply is committed with it, for retries."""
        self.confirmations = (
            text is not None and deps.approvals is not None and bool(self.state.runtime.awaiting)
        )
        """A user's message to a session that waits for a confirmation: the model may read the
        user's answer in it (see `keel.runtime._approvals`)."""
        self.registry: ToolRegistry = with_decision_tool(
            deps.workflow.registry(self.cursor), offered=self.confirmations
        )
        self._tools: ToolStep | None = None
        self.loop_start = 0
        """The log's length when the turn's loop started from it."""
        self.prompt = TurnPrompt(
            deps.engine,
            system_prompt=deps.system_prompt,
            rules=deps.rules,
            output_type=self.output_type,
            options=extras.model_options or deps.model_options,
            max_output_tokens=deps.model.profile.max_output_tokens,
            tools=self.registry.schemas(),
        )
        self.committed = False
        """Whether any checkpoint of this turn was written (a conflict then leaves it open)."""
        self.tool_calls: list[ToolCall] = []
        self.effects: list[tuple[ToolCall, Message]] = self._checkpointed_effects()
        """Side-effecting calls that ran, were replayed or are in doubt, with their results."""
        self._trace: RunTrace | None = None

    def _checkpointed_effects(self) -> list[tuple[ToolCall, Message]]:
        """A resumed turn's side-effecting calls that a process before this one ran and
        checkpointed with their results: a revert keeps them in the history like its own, or
        the model, no longer seeing them done, would make them again."""
        if not self.resume:
            return []
        segment = self.log.since(self.turn_start)
        answers = {m.tool_call_id: m for m in segment if m.role == "tool"}
        tools = self.deps.workflow.domain_tools
        return [
            (call, answers[call.id])
            for message in segment
            for call in message.tool_calls
            if call.id in answers and (found := tools.get(call.name)) and found.side_effect
        ]

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    @property
    def trace(self) -> RunTrace:
        """The turn's run in the trace store."""
        assert self._trace is not None, "the turn has not started"
        return self._trace

    # --- starting -------------------------------------------------------------------------------

    def _start(self, state: AgentState, text: str | None, turn_id: str | None) -> _Start:
        """The turn's first state: the open turn to finish, or the new message in the log."""
        runtime = state.runtime
        log = self.log
        if text is None:
            start = runtime.open_turn_message
            messages = state.messages
            if start is None or start >= len(messages):
                start = max(
                    (i for i, m in enumerate(messages) if is_user_turn(m)), default=len(messages)
                )
            user_message = messages[start] if start < len(messages) else Message.user("")
            turn_id = runtime.open_turn or uuid.uuid4().hex
            written = len(log)
        else:
            machine, position = self.deps.workflow.machine, self.cursor.position
            if position is not None and machine is not None and machine.is_terminal(position):
                # A finished workflow instance: the next message starts a new one.
                finished = (*runtime.finished_workflows, position.model_dump(mode="json"))
                runtime = runtime.model_copy(
                    update={"finished_workflows": finished[-_FINISHED_KEPT:]}
                )
                self.cursor = WorkflowCursor(machine.start(), emit=self.emit)
            metadata: dict[str, Any] = {"turn": runtime.turns + 1}
            metadata["turn_id"] = turn_id or uuid.uuid4().hex
            if turn_id is not None:
                metadata["client_turn"] = True
            turn_id = metadata["turn_id"]
            user_message = Message.user(self.deps.masking.mask(sanitize(text)), metadata=metadata)
            log.append(user_message)
            start = len(log) - 1
            runtime = runtime.model_copy(
                update={
                    "turns": metadata["turn"],
                    "open_turn": turn_id,
                    "open_turn_message": start,
                    "tenant_id": self.deps.tenant_id,
                    "user_id": self.user_id,
                }
            )
            # Until the turn's first checkpoint, the store holds the log up to the new message.
            written = len(log) - 1
        state = state.model_copy(
            update={"messages": log.live, "machine": self.cursor.position, "runtime": runtime}
        )
        assert turn_id is not None
        return _Start(turn_id, user_message, start, state, written)

    # --- the turn -------------------------------------------------------------------------------

    async def __call__(self) -> AgentReply:
        """Run the turn to its reply (a failure the turn owns is a reply too)."""
        deps = self.deps
        deps.owners[self.key] = (self.session_id, self.user_id)
        run = self._trace = await deps.tracer.astart_run(
            self.session_id,
            user_id=self.user_id,
            tenant_id=deps.tenant_id,
            agent=deps.name,
            input=self.user_message.content,
            attributes={"resumed": self.resume, "turn_id": self.turn_id},
            time_limit_s=deps.guards.run_timeout_s,
            buffered=True,
        )
        if self.resume:
            await deps.tracer.atake_over_turn(run, self.turn_id)
        try:
            self.prompt.memories = await deps.recall(self.user_id, self.user_message.content)
            if self.resume and self.state.runtime.awaiting:
                await self._settle()  # a parked turn goes on: its decisions first
            self.loop_start = len(self.log)
            result = await self._drive()
        except asyncio.CancelledError:
            # Ctrl-C, or a caller that stopped reading the stream: the turn stays open at its
            # last checkpoint for the next message to finish (unless the caller asked for it to
            # be closed), and its run says so.
            if self.on_cancel == "close" and await self._close_cancelled():
                raise
            await run.aend(error=TurnInterruptedError(self.session_id, "cancelled by the caller"))
            raise
        except ConflictError as exc:
            await run.aend("failed", error=exc)
            if isinstance(exc, TurnInterruptedError) or not self.committed:
                raise
            raise TurnInterruptedError(self.key, "another writer committed first") from exc
        except StoreError as exc:
            # The store itself failed: the turn stays open at its last checkpoint.
            await run.aend("failed", error=exc)
            raise
        except KeelError as exc:
            return await self._fail(exc)
        except Exception as exc:
            # A bug in user code the loop does not own (a hook, a tool gate): the turn ends
            # cleanly at the last good state instead of leaving it open for ever.
            logger.exception("turn on session %s failed unexpectedly", self.key)
            return await self._fail(KeelError(f"{type(exc).__name__}: {exc}"), cause=exc)
        return await self._commit(result)

    async def _drive(self) -> LoopResult:
        """The model-and-tools loop, driven here: a checkpoint and a compiled prompt before each
        model step, the trace (and a checkpoint after a transition) after each step."""
        deps = self.deps
        # The run's time limit covers the whole turn: what memory retrieval took is gone, and
        # a slice is kept back for the commit.
        margin = min(2.0, deps.guards.run_timeout_s * 0.1)
        guards = deps.guards.model_copy(
            update={"run_timeout_s": max(self.remaining() - margin, 0.001)}
        )
        tools = self.tools
        model = ModelStep(
            deps.model,
            tools.journal,
            guards=guards,
            monitor=deps.monitor,
            agent=deps.name,
            output_schema=self.output_type,
            options=self.prompt.options,
        )
        run = model.start(
            self.log.live,
            session_id=self.key,
            first_step=self.state.step,
            turn_id=self.turn_id,
            tools=self.registry.schemas(),
        )
        try:
            async with asyncio.timeout(guards.run_timeout_s):
                result = await self._steps(run, model, tools, guards)
        except TimeoutError:
            result = await self._end(run, time_limit(guards))
        if result.error is not None and guards.fallback == "raise":
            raise result.error
        return result

    @property
    def tools(self) -> ToolStep:
        """The turn's one tool step: its registry, the journal, the user's masking and vault,
        the scope its tools' contexts carry, and its approval hold, given the turn's facts
        (every call of the turn runs through it, a decided call too). Built once the turn's
        run is traced."""
        if self._tools is None:
            deps = self.deps
            scope = ToolScope(
                user_id=self.user_id,
                tenant_id=deps.tenant_id,
                run_id=self.trace.run_id,
                deps=self.tool_deps,
            )
            facts = TurnFacts(
                key=self.key,
                session_id=self.session_id,
                user_id=self.user_id,
                tenant_id=deps.tenant_id,
                turn_id=self.turn_id,
                mask=deps.masking.amask,
                trace=self.trace,
                emit=self.emit,
                before_side_effect=self._before_side_effect,
                confirmations=self.confirmations,
            )
            self._tools = ToolStep(
                self.registry,
                deps.journal,
                guards=deps.guards,
                redact=deps.masking.redact,
                scope=scope,
                vault=deps.masking.tool_vault,
                facts=facts,
                approvals=deps.approvals,
                aredact=None if deps.masking.redact is None else deps.masking.amask,
            )
        return self._tools

    @property
    def hold(self) -> ApprovalHold:
        """The turn's approval hold (its tool step's)."""
        return self.tools.hold

    async def _settle(self) -> None:
        """The parked turn goes on: the hold carries out or answers each decided request, its
        notes join the turn, and the turn is open again (a checkpoint before any model call),
        no longer waiting."""
        for note in await self.hold.settle(self.state.runtime.awaiting):
            self.log.append(note)
        runtime = self.state.runtime.model_copy(
            update={"awaiting": (), "open_turn": self.turn_id, "open_turn_message": self.turn_start}
        )
        await self.checkpoint({"runtime": runtime}, reason="approvals decided")
        # Marked only now that no checkpoint waits for them: a crash before leaves the turn
        # parked on them, for the next `carry_out_decisions` (or resume) to find again.
        await self.hold.mark_carried_out(self.hold.settled)

    async def _steps(
        self, run: LoopRun, model: ModelStep, tools: ToolStep, guards: GuardConfig
    ) -> LoopResult:
        stream = self.stream
        gate = ToolGate(
            refuse=self._refusal,
            before_side_effect=self._before_side_effect,
            on_start=stream.on_tool_start if stream is not None else None,
            on_result=stream.on_tool_result if stream is not None else None,
            fingerprint=self.cursor.fingerprint,
        )
        try:
            while True:
                run.begin(guards)
                sent = await self._before_model_call(run.step, run.history)
                outcome = await model.replay(run)
                if outcome is None:
                    options = self.prompt.sized(model.options)
                    on_text = stream.on_text if stream is not None else None
                    outcome = await model.ask(run, sent, options, on_text)
                await self._after_steps(run)
                if outcome.kind == "tool_calls":
                    await tools(run, outcome, gate)
                    if tools.hold.parked:
                        await self._after_steps(run)
                        return tools.hold.park(run)
                elif (result := model.conclude(run, outcome)) is not None:
                    await self._after_steps(run)
                    return result
                await self._after_steps(run)
        except LoopStop as stop:
            return await self._end(run, stop)

    async def _end(self, run: LoopRun, stop: LoopStop) -> LoopResult:
        """The run stops: its last step traced, and a guard's stop recorded in the trace (the
        commit reverts to the last good state)."""
        ended = run.halt(stop)
        await self._after_steps(run)
        if isinstance(ended, LoopResult):
            return ended
        if not isinstance(ended.error, GuardError):
            return run.stopped(ended, reverted=False)
        await self._on_guard_stop(ended.error)
        return run.stopped(ended, reverted=True)

    def _refusal(self, call: ToolCall) -> str | None:
        return self.deps.workflow.refusal(self.cursor.position, call)

    async def _before_side_effect(self, call: ToolCall) -> None:
        # A worker that stalled past its lease never acts on a session another one took over.
        await self.lease.check()

    async def _before_model_call(self, step: int, history: Sequence[Message]) -> list[Message]:
        await self.log.atake(history, self.deps.masking.amask_message)
        # The checkpoint before the model call: compare-and-set on the version we read.
        await self._append(
            {"step": step, "machine": self.cursor.position, "runtime": self.state.runtime},
            reason="before model call",
            step=step,
        )
        # The trace so far is made durable with the checkpoint: a process killed during the
        # model call leaves both at the same point.
        await self.trace.aflush()
        compiled = self.prompt.compile(
            self.log.conversation, self.deps.workflow.rules(self.cursor.position)
        )
        # The model is shown values only when the deployment trusts it; the log keeps masks.
        shown = self.prompt.last.placeholders if self.prompt.last is not None else None
        return await self.deps.masking.afor_model(compiled, shown)

    # --- after each step ------------------------------------------------------------------------

    async def _after_steps(self, run: LoopRun) -> None:
        for record in run.take_finished():
            await self._after_step(record)

    async def _after_step(self, record: StepRecord) -> None:
        self.prompt.note(record)
        await self.deps.masking.aplace_step(record)
        if self.stream is not None:
            self.stream.end_step(record)
        await arecord_loop_step(
            self.trace,
            record,
            model=self.deps.model.spec,
            budget=self.prompt.last.report if self.prompt.last else None,
            state_version=self.version,
            transitions=self.cursor.transitions,
        )
        self.cursor.transitions.clear()
        self._note_calls(record)
        if self.cursor.position != self.cursor.checkpointed:
            # A checkpoint after every transition (and slot gathered).
            await self._append(
                {"machine": self.cursor.position}, reason="after transition", step=record.step
            )
            self.cursor.checkpointed = self.cursor.position

    def _note_calls(self, record: StepRecord) -> None:
        """The step's successful calls (for memory) and its side effects (kept on a revert)."""
        masking = self.deps.masking
        calls = {call.id: call for call in (record.response.tool_calls if record.response else ())}
        for result in record.tool_results:
            if result.ok and result.tool not in WORKFLOW_TOOLS:
                call = ToolCall(id=result.call_id, name=result.tool, arguments=result.raw_arguments)
                self.tool_calls.append(masking.mask_call(call))
            if self.deps.workflow.ran_effect(result):
                call = calls.get(result.call_id) or ToolCall(
                    id=result.call_id, name=result.tool, arguments=result.raw_arguments
                )
                self.effects.append(
                    (masking.mask_call(call), masking.mask_message(result.to_message()))
                )

    async def _on_guard_stop(self, error: GuardError) -> None:
        await self.trace.arecord(
            "guard", type(error).__name__, error_type=type(error).__name__, error_message=str(error)
        )

    # --- checkpoints ----------------------------------------------------------------------------

    async def _write(self, state: AgentState, **options: Any) -> int:
        """A compare-and-set checkpoint of the turn on the version it last wrote or read."""
        version = await self.deps.state.acheckpoint(
            self.key, state, expected_version=self.version, **options
        )
        self.state = state
        self.written = len(state.messages)
        return self._written(version, options["reason"])

    async def checkpoint(self, update: dict[str, Any], *, reason: str) -> int:
        """A checkpoint of the log so far with ``update``'s fields set (the turn stays open)."""
        return await self._append(update, reason=reason)

    async def _append(self, update: dict[str, Any], **options: Any) -> int:
        """A compare-and-set checkpoint of the turn that appends the log's messages since the
        last one and sets ``update``'s fields: its cost is what is new, however long the
        session's history is."""
        new = self.log.since(self.written)
        version = await self.deps.state.aappend(
            self.key,
            {"messages": new} if new else {},
            update=update,
            expected_version=self.version,
            **options,
        )
        self.state = self.state.model_copy(update={**update, "messages": self.log.live})
        self.written += len(new)
        return self._written(version, options["reason"])

    def _written(self, version: int, reason: str) -> int:
        self.version = version
        self.committed = True
        # The log holds exactly the messages just written: it stays valid for the new version.
        self.log.version = version
        if self.emit is not None:
            self.emit(CheckpointCommitted(version=version, reason=reason))
        return version

    # --- ending ---------------------------------------------------------------------------------

    async def _commit(self, result: LoopResult) -> AgentReply:
        if self.stream is not None and result.truncated:
            self.stream.release_held()
        masking = self.deps.masking
        await self.log.atake_added(result.new_messages, self.loop_start, masking.amask_message)
        # What the model wrote: a placeholder it did not get from keel is stored defanged, so
        # neither this reply nor its replay or memory reveals it.
        text = await masking.amask_untrusted(sanitize(result.text))
        escalated = await self.hold.escalate(result)
        parked = result.status == "awaiting_approval" or escalated
        if escalated:
            text += ESCALATED_NOTE
        if result.ok or parked:
            final_state, rebuilt = self._completed_state(result)
        else:
            final_state, rebuilt = await self._reverted_state(result), True
            if self.effects:
                text += self._effects_note()
        position = final_state.machine
        reply = AgentReply(
            text=text,
            status="escalated" if escalated else result.status,
            session_id=self.session_id,
            run_id=self.trace.run_id,
            state_version=self.version + 1,
            workflow_state=position.state if position is not None else None,
            steps=len(result.steps),
            max_prompt_tokens=self.prompt.max_tokens,
            prompt_limit=self.deps.engine.budget.limit,
            loops_detected=result.loops_detected,
            tool_calls=tuple(r.tool for step in result.steps for r in step.tool_results),
            effects=tuple(call.name for call, _ in self.effects),
            reverted=not parked and (not result.ok or result.reverted),
            truncated=result.truncated,
            resumed=self.resume,
            output=result.output if result.ok else None,
            error=await masking.amask(result.error_message) if result.error_message else None,
            approvals=tuple(pending_view(r) for r in self.hold.requested),
        )
        reason = "turn completed" if result.ok else f"turn failed: {result.status}"
        if parked:
            reason = "turn parked: " + ("escalated" if escalated else "awaiting approval")
        version = await self._save(self._with_reply(final_state, reply), reason, rebuilt=rebuilt)
        if result.ok:
            version = await self._summarize(self.state, version)
            await self._hand_off(text, position)
        await self.trace.aend(
            "succeeded" if result.ok else _run_status(result.status),
            output=text,
            error=result.error,
        )
        if not self.reveal:
            # For a caller who may not read the user's values: the reply as stored, and the
            # structured answer masked as its text was.
            shown = {"output": await masking.view.amask_output(reply.output)}
        else:
            # The user reads their own values; what was stored keeps the placeholders.
            shown = {
                "text": await masking.areveal(text),
                "output": await masking.areveal_output(reply.output),
            }
        return reply.model_copy(update={"state_version": version, **shown})

    async def _save(self, final_state: AgentState, reason: str, *, rebuilt: bool) -> int:
        """The turn's last checkpoint, marked good."""
        if rebuilt:
            version = await self._write(final_state, reason=reason, good=True)
            # History was rewritten: the log is built again from the store next turn.
            self.deps.logs.pop(self.key, None)
            return version
        # The turn's messages stand as they are: appended, whatever the history's length.
        fields = ("step", "machine", "runtime")
        return await self._append(
            {name: getattr(final_state, name) for name in fields}, reason=reason, good=True
        )

    def _completed_state(self, result: LoopResult) -> tuple[AgentState, bool]:
        """The state of a completed turn, and whether its history was rebuilt: its messages
        are the log itself unless the runtime's corrections had to be dropped from it."""
        # Still waiting for what it waited for (a message that decided nothing), and more.
        requested = (request.id for request in self.hold.requested)
        awaiting = tuple(dict.fromkeys((*self.state.runtime.awaiting, *requested)))
        runtime = self.state.runtime.model_copy(
            update={"open_turn": None, "open_turn_message": None, "awaiting": awaiting}
        )
        segment = self.log.since(self.turn_start)
        kept = without_corrections(segment)
        update: dict[str, Any] = {
            "step": max(result.next_step, self.state.step),
            "machine": self.cursor.position,
            "runtime": runtime,
        }
        rebuilt = len(kept) != len(segment)
        if rebuilt:
            update["messages"] = [*self.log.messages[: self.turn_start], *kept]
        return self.state.model_copy(update=update), rebuilt

    async def _reverted_state(self, result: LoopResult) -> AgentState:
        """The last good state, with the exchange, the effects, and the failure counted."""
        base = await self._failure_base()
        machine, position = self.deps.workflow.machine, base.machine
        status = result.status
        if machine is not None and position is not None:
            before_state = position.state
            position = machine.record_failure(position, status)
            if position.state != before_state:
                await self.trace.arecord(
                    "reset", "reset", error_message=position.failure_reason or status
                )
        runtime = self.state.runtime.model_copy(
            update={
                "open_turn": None,
                "open_turn_message": None,
                "summary": base.runtime.summary,
                "messages_summarized": base.runtime.messages_summarized,
                "turns_summarized": base.runtime.turns_summarized,
            }
        )
        return base.model_copy(
            update={
                "messages": self._reverted_messages(base, unanswered_note(status)),
                "step": max(result.next_step, self.state.step),
                "machine": position,
                "runtime": runtime,
            }
        )

    def _reverted_messages(self, base: AgentState, note: Message) -> list[Message]:
        """The last good messages, then the user's message, the side effects that happened and
        keel's note that the turn got no answer."""
        effects: list[Message] = []
        if self.effects:
            calls = tuple(call for call, _ in self.effects)
            effects = [Message.assistant("", tool_calls=calls), *(r for _, r in self.effects)]
        return [*base.messages, self.user_message, *effects, note]

    def _effects_note(self) -> str:
        done = "; ".join(
            f"{call.name}: {clip(result.content, 160)}" for call, result in self.effects
        )
        return f"\n\nWhat was done before I stopped: {done}"

    async def _failure_base(self) -> AgentState:
        # Back to the last good checkpoint, keeping the exchange and the failure count.
        last_good = await self.deps.state.alast_good(self.key)
        if last_good is None:
            written = list(self.state.messages[: self.written])
            return self.state.model_copy(update={"messages": written})
        return (await self.deps.state.aat(self.key, last_good.version)).state

    async def _fail(self, error: KeelError, *, cause: BaseException | None = None) -> AgentReply:
        """A failure outside the loop's own handling: back to the last good state, keeping the
        user's message and any side effect that happened. The run ends with what the user is
        told (``cause``: the error as raised, when ``error`` wraps it)."""
        text = _FAILURE_REPLY
        if self.effects:
            text = (
                "I'm sorry, something went wrong on my side before I could finish."
                + self._effects_note()
            )
        await self.trace.aend(error=cause or error, output=text)
        base = await self._failure_base()
        final_state = self._closed_state(base, unanswered_note("failed"))
        reply = AgentReply(
            text=text,
            status="failed",
            session_id=self.session_id,
            run_id=self.trace.run_id,
            state_version=self.version + 1,
            workflow_state=base.machine.state if base.machine is not None else None,
            effects=tuple(call.name for call, _ in self.effects),
            reverted=True,
            error=await self.deps.masking.amask(f"{type(error).__name__}: {error}"),
        )
        final_state = self._with_reply(final_state, reply)
        version = await self._write(final_state, reason="turn failed: failed", good=True)
        self.deps.logs.pop(self.key, None)
        shown = await self.deps.masking.areveal(text) if self.reveal else text
        return reply.model_copy(update={"state_version": version, "text": shown})

    async def _close_cancelled(self) -> bool:
        """End the turn its caller cancelled, at the last good state with the user's message,
        the side effects that happened and keel's note that the user cancelled it: no later
        turn finishes it. False when it could not be written (the turn then stays open)."""
        try:
            base = await self._failure_base()
            final_state = self._closed_state(base, cancelled_note())
            await self._write(final_state, reason="turn cancelled", good=True)
        except (ConflictError, StoreError):
            logger.warning("the cancelled turn on session %s stays open", self.key, exc_info=True)
            return False
        finally:
            self.deps.logs.pop(self.key, None)
        reason = "cancelled by the user: the turn was closed without an answer"
        await self.trace.aend("interrupted", error=asyncio.CancelledError(reason))
        return True

    def _closed_state(self, base: AgentState, note: Message) -> AgentState:
        """``base`` (the last good state) with this turn closed on ``note``: the user's
        message, the side effects that happened, then the note."""
        runtime = base.runtime.model_copy(
            update={
                "turns": self.state.runtime.turns,
                "open_turn": None,
                "open_turn_message": None,
                "tenant_id": self.deps.tenant_id,
                "user_id": self.user_id,
            }
        )
        return base.model_copy(
            update={
                "messages": self._reverted_messages(base, note),
                "step": max(self.state.step, base.step),
                "runtime": runtime,
            }
        )

    def _with_reply(self, state: AgentState, reply: AgentReply) -> AgentState:
        if not self.record_reply:
            return state
        return with_reply(state, self.turn_id, self.user_message.content, reply)

    async def _summarize(self, committed: AgentState, version: int) -> int:
        """Fold old turns into the running summary after the commit, within the time left;
        a summary that cannot be finished or saved is simply tried again next turn."""
        log = self.deps.logs.of(self.deps.engine, self.key, committed, version)
        appending = log is self.log
        conversation = log.conversation
        remaining = self.remaining()
        if not conversation.needs_summary or remaining <= 0:
            return version
        try:
            async with asyncio.timeout(remaining):
                outcome = await conversation.asummarize()
        except TimeoutError:
            return version
        if outcome is None or not outcome.committed:
            return version
        runtime = committed.runtime.model_copy(
            update={
                "summary": conversation.summary,
                "messages_summarized": log.messages_summarized,
                "turns_summarized": conversation.turns_summarized,
            }
        )
        try:
            if appending:
                version = await self._append({"runtime": runtime}, reason="summary", good=True)
            else:
                summarized = committed.model_copy(update={"runtime": runtime})
                version = await self._write(summarized, reason="summary", good=True)
        except (ConflictError, StoreError):
            # The turn is committed; only its summary is not. The conversation already folded
            # the turns, so it is rebuilt from the store next time.
            self.deps.logs.pop(self.key, None)
            logger.warning("the summary of session %s could not be saved", self.key)
            return version
        log.version = version
        return version

    async def _hand_off(self, reply: str, position: MachinePosition | None) -> None:
        """The committed turn's words to memory, and a workflow run that reached its goal."""
        memory, machine = self.deps.memory, self.deps.workflow.machine
        if memory is None:
            return
        await memory.remember_turn(
            self.session_id,
            self.user_id,
            self.state.runtime.turns,
            self.user_message.content,
            reply,
        )
        if (
            machine is not None
            and position is not None
            and machine.is_terminal(position)
            and position.state != machine.failure
        ):
            task = next((m.content for m in self.state.messages if is_user_turn(m)), "")
            await memory.remember_run(self.session_id, self.user_id, task, self.tool_calls)


def _run_status(status: str) -> Any:
    if status in ("step_limit", "time_limit"):
        return "limited"
    if status in ("loop_detected", "tool_in_doubt", "awaiting_approval"):
        # Handed to a person (DESIGN.md, "Turn outcomes").
        return "escalated"
    return "failed"
