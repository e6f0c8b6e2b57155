"""One turn, driven by the object that runs it: `TurnRunner`.

The [`Agent`][] is configuration; what a turn needs of it is one immutable `TurnDeps` (the
model, the stores, the context engine, the guards, the privacy policy, the workflow...), handed
over once by the agent. A runner is built per turn over those dependencies and the turn's own
facts (the session, the user, the state it starts from). It drives the steps: the checkpoint
before each model call, the model step and the tool step (`keel.runtime._loop_run`), the trace
after each step. What the turn writes (checkpoints, the commit or the revert, the summary, the
hand-off to memory) is its writer's (`keel.runtime._commit.TurnWriter`), which owns the
session's version.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypedDict

from keel.context import ContextEngine
from keel.errors import ConflictError, GuardError, KeelError, StoreError, TurnInterruptedError
from keel.guards import GuardConfig, SpiralMonitor
from keel.messages import Message
from keel.models import ChatModel, ModelOptions
from keel.runtime._approvals import ApprovalHold, Approvals, TurnFacts, with_decision_tool
from keel.runtime._commit import MemoryHandOff, TurnEnd, TurnWriter, WriterPolicy
from keel.runtime._events import AgentEvent, TurnStream
from keel.runtime._log import SessionLogs
from keel.runtime._loop_run import LoopResult, LoopRun, LoopStop, StepRecord, time_limit
from keel.runtime._masking import Masking
from keel.runtime._model_step import ModelStep, TurnPrompt
from keel.runtime._reply import AgentReply
from keel.runtime._tool_step import ToolStep
from keel.runtime._workflow import Workflow, WorkflowCursor
from keel.state import AgentState, StateStore
from keel.tools import ToolJournal, ToolScope
from keel.tracing import Tracer, arecord_loop_step
from keel.tracing._loop import SentPrompt

__all__ = ["RunExtras", "TurnDeps", "TurnOptions", "TurnRunner"]

logger = logging.getLogger("keel.runtime")


@dataclass(frozen=True)
class TurnDeps:
    """What a turn needs of its agent, handed over by the agent (``Agent._hand_over``) and
    fixed until its configuration changes: nothing in it changes while turns run."""

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
    memory: MemoryHandOff | None
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


class Lease(Protocol):
    """The caller's hold on the session (``keel.runtime._session.Lease``)."""

    async def check(self) -> None:
        """Renew now; raise when another owner has taken the session."""


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


class TurnRunner:
    """Runs one turn on a session the caller holds the lease of (see the module docstring).

    Args:
        deps: the agent's dependencies, for the turn's user.
        logs: the agent's kept session logs.
        lease: the caller's lease on the session (renewed before each side effect).
        key / session_id / user_id: the session's store key, its id, and the user.
        state / version: the session's state as loaded, and its version.
        text: the user's message; None finishes the turn the session has open.
        emit: where a streamed turn's events go (None: not streamed).
        extras: the call's own options.
    """

    def __init__(
        self,
        deps: TurnDeps,
        logs: SessionLogs,
        lease: Lease,
        ids: tuple[str, str, str],
        loaded: tuple[AgentState, int],
        text: str | None,
        emit: Callable[[AgentEvent], None] | None = None,
        extras: RunExtras | None = None,
    ) -> None:
        extras = extras or RunExtras()
        self.deps, self.lease, self.extras, self.emit = deps, lease, extras, emit
        self.key, self.session_id, self.user_id = ids
        self.resume = text is None
        self.deadline = time.monotonic() + deps.guards.run_timeout_s
        policy = WriterPolicy(deps.tenant_id, deps.masking, deps.workflow, deps.memory)
        self.writer = TurnWriter.opened(
            deps.state, logs, ids, loaded, text, turn_id=extras.turn_id, policy=policy, emit=emit
        )
        self.log = self.writer.log
        self.stream = TurnStream(emit, deps.masking) if emit is not None else None
        self.cursor = WorkflowCursor(self.writer.state.machine, emit=emit)
        self.confirmations = text is not None and bool(
            deps.approvals and loaded[0].runtime.awaiting
        )
        """A user's message to a session that waits for a confirmation: the model may read the
        user's answer in it (see `keel.runtime._approvals`)."""
        self.registry = with_decision_tool(
            deps.workflow.registry(self.cursor), offered=self.confirmations
        )
        self.prompt = TurnPrompt(
            deps.engine,
            system_prompt=deps.system_prompt,
            rules=deps.rules,
            output_type=extras.output_type or deps.output_type,
            options=extras.model_options or deps.model_options,
            max_output_tokens=deps.model.profile.max_output_tokens,
            tools=self.registry.schemas(),
        )

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    # --- the turn -------------------------------------------------------------------------------

    async def __call__(self) -> AgentReply:
        """Run the turn to its reply (a failure the turn owns is a reply too)."""
        deps, writer = self.deps, self.writer
        run = writer.run = await deps.tracer.astart_run(
            self.session_id,
            user_id=self.user_id,
            tenant_id=deps.tenant_id,
            agent=deps.name,
            input=writer.user_message.content,
            attributes={"resumed": self.resume, "turn_id": writer.traced_turn_id},
            time_limit_s=deps.guards.run_timeout_s,
            buffered=True,
        )
        if self.resume:
            await deps.tracer.atake_over_turn(run, writer.turn_id)
        reveal = self.extras.reveal
        tools: ToolStep | None = None
        try:
            if deps.memory is not None:
                query = writer.user_message.content
                self.prompt.memories = await deps.memory.recall(self.user_id, query, writer.shown)
            tools = self._tool_step()
            if self.resume and writer.state.runtime.awaiting:
                await self._settle(tools.hold)  # a parked turn goes on: its decisions first
            loop_start = len(self.log)
            result = await self._drive(tools)
        except asyncio.CancelledError:
            # Ctrl-C, or a caller that stopped reading the stream: the turn stays open at its
            # last checkpoint for the next message to finish (unless the caller asked for it to
            # be closed), and its run says so.
            if self.extras.on_cancel == "close" and await writer.close_cancelled():
                raise
            await run.aend(error=TurnInterruptedError(self.session_id, "cancelled by the caller"))
            raise
        except ConflictError as exc:
            await run.aend("failed", error=exc)
            if isinstance(exc, TurnInterruptedError) or not writer.committed:
                raise
            raise TurnInterruptedError(self.key, "another writer committed first") from exc
        except StoreError as exc:
            # The store itself failed: the turn stays open at its last checkpoint.
            await run.aend("failed", error=exc)
            raise
        except KeelError as exc:
            return await writer.fail(exc, reveal=reveal)
        except Exception as exc:
            # A bug in user code the loop does not own (a hook, a tool gate): the turn ends
            # cleanly at the last good state instead of leaving it open for ever.
            logger.exception("turn on session %s failed unexpectedly", self.key)
            error = KeelError(f"{type(exc).__name__}: {exc}")
            return await writer.fail(error, cause=exc, reveal=reveal)
        if self.stream is not None and result.truncated:
            self.stream.release_held()
        ends = TurnEnd(
            loop_start=loop_start,
            position=self.cursor.position,
            max_prompt_tokens=self.prompt.max_tokens,
            prompt_limit=deps.engine.budget.limit,
            deadline=self.deadline,
            reveal=reveal,
        )
        assert tools is not None
        return await writer.commit(result, tools.hold, ends)

    def _tool_step(self) -> ToolStep:
        """The turn's one tool step: its registry, the journal, the user's masking and vault,
        the scope its tools' contexts carry, the workflow's gate, the lease check and its
        approval hold, given the turn's facts (every call of the turn runs through it, a
        decided call too)."""
        deps, writer, cursor, workflow = self.deps, self.writer, self.cursor, self.deps.workflow
        scope = ToolScope(
            user_id=self.user_id,
            tenant_id=deps.tenant_id,
            run_id=writer.trace.run_id,
            deps=self.extras.deps,
        )
        facts = TurnFacts(
            key=self.key,
            session_id=self.session_id,
            user_id=self.user_id,
            tenant_id=deps.tenant_id,
            turn_id=writer.turn_id,
            mask=deps.masking.amask,
            trace=writer.trace,
            emit=self.emit,
            # A worker that stalled past its lease never acts on a session another one took.
            before_side_effect=lambda call: self.lease.check(),
            confirmations=self.confirmations,
        )
        return ToolStep(
            self.registry,
            deps.journal,
            guards=deps.guards,
            redact=deps.masking.redact,
            scope=scope,
            vault=deps.masking.tool_vault,
            facts=facts,
            approvals=deps.approvals,
            aredact=None if deps.masking.redact is None else deps.masking.amask,
            refuse=lambda call: workflow.refusal(cursor.position, call),
            events=self.stream,
        )

    async def _settle(self, hold: ApprovalHold) -> None:
        """The parked turn goes on: the hold carries out or answers each decided request, its
        notes join the turn, and the turn is open again (a checkpoint before any model call),
        no longer waiting."""
        writer = self.writer
        for note in await hold.settle(writer.state.runtime.awaiting):
            self.log.append(note)
        runtime = writer.state.runtime.model_copy(
            update={
                "awaiting": (),
                "open_turn": writer.turn_id,
                "open_turn_message": writer.turn_start,
            }
        )
        await writer.checkpoint({"runtime": runtime}, reason="approvals decided")
        # Marked only now that no checkpoint waits for them: a crash before leaves the turn
        # parked on them, for the next `carry_out_decisions` (or resume) to find again.
        await hold.mark_carried_out(hold.settled)

    async def _drive(self, tools: ToolStep) -> LoopResult:
        """The model-and-tools loop, driven here: a checkpoint and a compiled prompt before each
        model step, the trace (and a checkpoint after a transition) after each step."""
        deps = self.deps
        # The run's time limit covers the whole turn (memory recall spent some), less a slice.
        margin = min(2.0, deps.guards.run_timeout_s * 0.1)
        guards = deps.guards.model_copy(
            update={"run_timeout_s": max(self.remaining() - margin, 0.001)}
        )
        model = ModelStep(
            deps.model,
            tools.journal,
            guards=guards,
            monitor=deps.monitor,
            agent=deps.name,
            output_schema=self.extras.output_type or deps.output_type,
            options=self.prompt.options,
        )
        run = model.start(
            self.log.live,
            session_id=self.key,
            first_step=self.writer.state.step,
            turn_id=self.writer.turn_id,
            tools=self.registry.schemas(),
            decided_before=self.writer.decided_before,
        )
        try:
            async with asyncio.timeout(guards.run_timeout_s):
                result = await self._steps(run, model, tools, guards)
        except TimeoutError:
            result = await self._end(run, time_limit(guards))
        if result.error is not None and guards.fallback == "raise":
            raise result.error
        return result

    async def _steps(
        self, run: LoopRun, model: ModelStep, tools: ToolStep, guards: GuardConfig
    ) -> LoopResult:
        stream = self.stream
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
                    calls = await tools(run, outcome)
                    tools.finish(calls, self.cursor.fingerprint())
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
        name = type(ended.error).__name__
        await self.writer.trace.arecord(
            "guard", name, error_type=name, error_message=str(ended.error)
        )
        return run.stopped(ended, reverted=True)

    async def _before_model_call(self, step: int, history: Sequence[Message]) -> Sequence[Message]:
        writer, masking = self.writer, self.deps.masking
        await self.log.atake(history, masking.amask_message)
        # The checkpoint before the model call: compare-and-set on the version we read.
        update = {"step": step, "machine": self.cursor.position, "runtime": writer.state.runtime}
        # The trace so far is made durable with the checkpoint (one commit): a process killed
        # during the model call leaves both at the same point.
        batch = writer.trace.take_batch()
        await writer.checkpoint(update, reason="before model call", step=step, trace=batch)
        rules = self.deps.workflow.rules(self.cursor.position)
        compiled = self.prompt.compile(self.log.conversation, rules)
        # The model is shown values only when the deployment trusts it; the log keeps masks.
        shown = self.prompt.last.placeholders if self.prompt.last is not None else None
        return await masking.afor_model(compiled, shown)

    async def _after_steps(self, run: LoopRun) -> None:
        for record in run.take_finished():
            await self._after_step(record)

    async def _after_step(self, record: StepRecord) -> None:
        writer, cursor = self.writer, self.cursor
        self.prompt.note(record)
        await self.deps.masking.aplace_step(record)
        if self.stream is not None:
            self.stream.end_step(record)
        await arecord_loop_step(
            writer.trace,
            record,
            model=self.deps.model.spec,
            budget=self.prompt.last.report if self.prompt.last else None,
            state_version=writer.version,
            transitions=cursor.transitions,
            prompt=SentPrompt.of(self.prompt.last, self.log.live, self.log.conversation_start),
        )
        cursor.transitions.clear()
        writer.note_step(record)
        if cursor.position != cursor.checkpointed:
            # A checkpoint after every transition (and slot gathered).
            update = {"machine": cursor.position}
            await writer.checkpoint(update, reason="after transition", step=record.step)
            cursor.checkpointed = cursor.position
