"""What one turn writes, owned by one object: `TurnWriter`.

The writer owns the session's version as the turn last wrote or read it and how much of the
log that version holds (``written``); every write of the turn goes through it: the checkpoint
before each model call and after each transition (compare-and-set, appending only what is
new), and at the end the commit, or the revert to the last good state (keeping the user's
message and the side effects that happened), the running summary, and the hand-off of the
committed turn to long-term memory (`MemoryHandOff`: the turn's words, a finished workflow run,
the summary, each under the session and user the writer knows). The runner (`TurnRunner`)
drives the steps and tells the writer what happened; the writer never drives.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from keel._bridge import run_blocking
from keel.context import ContextMemory, runtime_note
from keel.errors import ConflictError, KeelError, StoreError
from keel.memory import MemoryFilter, Provenance, Scope, ShownSession
from keel.memory._records import RUN_TYPE
from keel.messages import Message, ToolCall
from keel.privacy import Vault, storable
from keel.runtime._approvals import ESCALATED_NOTE, ApprovalHold, pending_view
from keel.runtime._events import AgentEvent, CheckpointCommitted
from keel.runtime._log import SessionLog, SessionLogs
from keel.runtime._loop_run import LoopResult, StepRecord
from keel.runtime._reply import AgentReply, with_reply
from keel.runtime._workflow import WORKFLOW_TOOLS, Workflow
from keel.state import AgentState, MachinePosition, StateStore
from keel.stores import SQLTraceStore
from keel.stores._sql_plan import Rider, riding
from keel.tracing import RunStatus, RunTrace, TraceBatch
from keel.tracing._redact import OwnId

if TYPE_CHECKING:
    from keel.memory import Memory
    from keel.runtime._masking import Masking

__all__ = [
    "SUMMARY_KEY_PREFIX",
    "MemoryHandOff",
    "TurnEnd",
    "TurnWriter",
    "WriterPolicy",
    "hand_off",
    "is_user_turn",
]

_FINISHED_KEPT = 20
"""Finished workflow instances a session keeps."""

logger = logging.getLogger("keel.runtime")

SUMMARY_KEY_PREFIX = "keel:summary:"
"""A session's running summary is kept in memory under this prefix and the session id."""

_FAILURE_REPLY = (
    "I'm sorry, something went wrong on my side and nothing was changed. Please try again."
)


class TurnWriter:
    """The writes of one turn on a session the caller holds the lease of (see the module);
    built by `opened`.

    Args:
        store / logs / log: the state store, the agent's kept session logs (a turn that
            rewrites history drops its own), and the session's log at ``version``.
        ids: the session's store key, its id, and the user.
        state / version / written: the turn's first state (its ``messages`` the log), the
            version it was read at, and the messages of the log that version holds.
        user_message / turn_id / turn_start: the turn's user message, its id, and its place
            in the log.
        policy: the tenant, the turn's privacy view, the agent's workflow and its hand-off to
            memory.
        emit: where a streamed turn's events go.
        resumed: the turn finishes one a crash (or a park) left open.
    """

    def __init__(
        self,
        store: StateStore[AgentState],
        logs: SessionLogs,
        log: SessionLog,
        ids: tuple[str, str, str],
        *,
        state: AgentState,
        version: int,
        written: int,
        user_message: Message,
        turn_id: str,
        turn_start: int,
        policy: WriterPolicy,
        emit: Callable[[AgentEvent], None] | None,
        resumed: bool,
    ) -> None:
        self.store, self.logs, self.log = store, logs, log
        self.key, self.session_id, self.user_id = ids
        self.tenant_id = policy.tenant_id
        self.masking, self.workflow, self.memory = policy.masking, policy.workflow, policy.memory
        self.state = state
        """The turn's state as of its last checkpoint, except ``messages``: while the turn
        appends to the log, that is the log itself (see ``written``)."""
        self.version = version
        self.written = written
        """Messages of the log the checkpoint at ``version`` holds: the rest are the next
        append."""
        self.user_message, self.turn_id, self.turn_start = user_message, turn_id, turn_start
        self.emit, self.resumed = emit, resumed
        self.record_reply = bool(user_message.metadata.get("client_turn"))
        """The caller gave the turn its id: its reply is committed with it, for retries."""
        self.committed = False
        """Whether any checkpoint of this turn was written (a conflict then leaves it open)."""
        self.tool_calls: list[ToolCall] = []
        """The turn's successful calls, masked (a finished workflow run is remembered)."""
        self.effects = self._checkpointed_effects() if resumed else []
        """Side-effecting calls that ran, were replayed or are in doubt, with their results."""
        self.run: RunTrace | None = None
        """The turn's run in the trace store, once started."""

    @property
    def traced_turn_id(self) -> str:
        """The turn's id as its run's trace records it: keel's own kept whole (an `OwnId`:
        it holds nothing of the user's), a caller's redacted as any text is."""
        return self.turn_id if self.record_reply else OwnId(self.turn_id)

    @classmethod
    def opened(
        cls,
        store: StateStore[AgentState],
        logs: SessionLogs,
        ids: tuple[str, str, str],
        loaded: tuple[AgentState, int],
        text: str | None,
        *,
        turn_id: str | None,
        policy: WriterPolicy,
        emit: Callable[[AgentEvent], None] | None = None,
    ) -> TurnWriter:
        """The writer of the turn that ``text`` opens on the session ``loaded`` (its state
        and version): the new message in the log (a finished workflow instance closed first);
        None finishes the turn the session has open."""
        state, version = loaded
        runtime, log = state.runtime, logs.of(ids[0], state, version)
        machine, position = policy.workflow.machine, state.machine
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
            if position is not None and machine is not None and machine.is_terminal(position):
                # A finished workflow instance: the next message starts a new one.
                finished = (*runtime.finished_workflows, position.model_dump(mode="json"))
                runtime = runtime.model_copy(
                    update={"finished_workflows": finished[-_FINISHED_KEPT:]}
                )
                position = machine.start()
            metadata: dict[str, Any] = {"turn": runtime.turns + 1}
            metadata["turn_id"] = turn_id or uuid.uuid4().hex
            if turn_id is not None:
                metadata["client_turn"] = True
            turn_id = metadata["turn_id"]
            masked = policy.masking.mask(storable(text))
            user_message = Message.user(masked, metadata=metadata)
            log.append(user_message)
            start = len(log) - 1
            runtime = runtime.model_copy(
                update={
                    "turns": metadata["turn"],
                    "open_turn": turn_id,
                    "open_turn_message": start,
                    "tenant_id": policy.tenant_id,
                    "user_id": ids[2],
                }
            )
            # Until the turn's first checkpoint, the store holds the log up to the new message.
            written = len(log) - 1
        state = state.model_copy(
            update={"messages": log.live, "machine": position, "runtime": runtime}
        )
        assert turn_id is not None
        return cls(
            store,
            logs,
            log,
            ids,
            state=state,
            version=version,
            written=written,
            user_message=user_message,
            turn_id=turn_id,
            turn_start=start,
            policy=policy,
            emit=emit,
            resumed=text is None,
        )

    @property
    def trace(self) -> RunTrace:
        """The turn's run in the trace store."""
        assert self.run is not None, "the turn has not started"
        return self.run

    @property
    def decided_before(self) -> bool:
        """Whether a run before this turn's may have journalled a decision under its id: not
        for a new message under an id keel has just made (no run before knows it, so the
        first step looks nothing up); a resumed turn, or one its caller named, may have."""
        return self.resumed or self.record_reply

    @property
    def loaded(self) -> tuple[AgentState, int]:
        """The session as this turn last wrote it (its state and version): what the session's
        next turn starts from, without reading the store again (its messages are the log's,
        not copied: read them, never change them)."""
        return self.state, self.version

    @property
    def shown(self) -> ShownSession:
        """What the turn's prompt shows of its session that memory holds too, for its recall
        to leave out: the running summary (archived under the session's key), and the turns
        from the first whose user message is in the window on (the window as the session's
        last prompt had it: this turn's is compiled after its recall). A turn whose message
        the window lost keeps its records searchable, its reply too."""
        first = None
        for message in self.log.conversation.window_messages():
            if is_user_turn(message) and isinstance(turn := message.metadata.get("turn"), int):
                first = turn
                break
        summary = f"{SUMMARY_KEY_PREFIX}{self.session_id}"
        return ShownSession(session_id=self.session_id, first_turn=first, summary_key=summary)

    def _checkpointed_effects(self) -> list[tuple[ToolCall, Message]]:
        """A resumed turn's side-effecting calls that a process before this one ran and
        checkpointed with their results: a revert keeps them in the history like its own, or
        the model, no longer seeing them done, would make them again."""
        segment = self.log.since(self.turn_start)
        answers = {m.tool_call_id: m for m in segment if m.role == "tool"}
        tools = self.workflow.domain_tools
        return [
            (call, answers[call.id])
            for message in segment
            for call in message.tool_calls
            if call.id in answers and (found := tools.get(call.name)) and found.side_effect
        ]

    # --- while the turn runs ----------------------------------------------------------------

    async def checkpoint(
        self, update: dict[str, Any], *, trace: TraceBatch | None = None, **options: Any
    ) -> int:
        """A compare-and-set checkpoint of the turn that appends the log's messages since the
        last one and sets ``update``'s fields (the turn stays open unless ``update`` closes
        it): its cost is what is new, however long the session's history is.

        ``trace``: the run's writes taken out of it (``RunTrace.take_batch``), made durable
        with the checkpoint: in its transaction where the trace is in the state's SQLite file
        (one commit, not two), else written right after it."""
        options.setdefault("reason", "update")
        new = self.log.since(self.written)
        version = await self._carrying(
            trace,
            lambda: self.store.aappend(
                self.key,
                {"messages": new} if new else {},
                update=update,
                expected_version=self.version,
                **options,
            ),
        )
        self.state = self.state.model_copy(update={**update, "messages": self.log.live})
        self.written += len(new)
        return self._written(version, options["reason"])

    async def _write(
        self, state: AgentState, *, trace: TraceBatch | None = None, **options: Any
    ) -> int:
        """A compare-and-set checkpoint of the whole ``state`` (history rewritten): the log
        is built again from the store next turn. ``trace``: as [`checkpoint`][]'s."""
        version = await self._carrying(
            trace,
            lambda: self.store.acheckpoint(
                self.key, state, expected_version=self.version, **options
            ),
        )
        self.state = state
        self.written = len(state.messages)
        return self._written(version, options["reason"])

    async def _carrying(self, batch: TraceBatch | None, write: Callable[[], Awaitable[int]]) -> int:
        """``write()`` with the trace's ``batch`` riding in its transaction, then the batch
        handed back to the run: written, failed (logged, as a failed flush), or, where it
        could not ride (a trace kept elsewhere), written on its own after the checkpoint. A
        checkpoint that fails hands it back unwritten, for the run's next flush or end."""
        rider = _rider(batch)
        try:
            with riding(rider):
                version = await write()
        except BaseException:
            if batch is not None:
                self.trace.batch_returned(batch)
            raise
        if batch is not None:
            if rider is not None and rider.ran:
                self.trace.batch_written(batch)
            elif rider is not None and rider.error is not None:
                self.trace.batch_failed(batch, rider.error)
            else:
                await self.trace.awrite(batch)
        return version

    def _written(self, version: int, reason: str) -> int:
        self.version = version
        self.committed = True
        # The log holds exactly the messages just written: it stays valid for the new version.
        self.log.version = version
        if self.emit is not None:
            self.emit(CheckpointCommitted(version=version, reason=reason))
        return version

    def note_step(self, record: StepRecord) -> None:
        """The step's successful calls (for memory) and its side effects (kept on a revert)."""
        masking = self.masking
        calls = {call.id: call for call in (record.response.tool_calls if record.response else ())}
        for result in record.tool_results:
            if result.ok and result.tool not in WORKFLOW_TOOLS:
                call = ToolCall(id=result.call_id, name=result.tool, arguments=result.raw_arguments)
                self.tool_calls.append(masking.mask_call(call))
            if self.workflow.ran_effect(result):
                call = calls.get(result.call_id) or ToolCall(
                    id=result.call_id, name=result.tool, arguments=result.raw_arguments
                )
                self.effects.append(
                    (masking.mask_call(call), masking.mask_message(result.to_message()))
                )

    # --- the end of the turn ----------------------------------------------------------------

    async def commit(self, result: LoopResult, hold: ApprovalHold, ends: TurnEnd) -> AgentReply:
        """The turn's last checkpoint: the loop's result committed (marked good), or parked on
        what the hold holds, or the last good state with the failure counted; then the running
        summary, the hand-off to memory and the run's end in the trace. The reply, shown as
        ``ends.reveal`` says."""
        masking = self.masking
        await self.log.atake_added(result.new_messages, ends.loop_start, masking.amask_message)
        # What the model wrote: a placeholder it did not get from keel is stored defanged, so
        # neither this reply nor its replay or memory reveals it.
        text = await masking.amask_untrusted(storable(result.text))
        escalated = await hold.escalate(result)
        parked = result.status == "awaiting_approval" or escalated
        if escalated:
            text += ESCALATED_NOTE
        if result.ok or parked:
            final_state, rebuilt = self._completed_state(result, hold, ends.position)
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
            max_prompt_tokens=ends.max_prompt_tokens,
            prompt_limit=ends.prompt_limit,
            loops_detected=result.loops_detected,
            tool_calls=tuple(r.tool for step in result.steps for r in step.tool_results),
            effects=tuple(call.name for call, _ in self.effects),
            reverted=not parked and (not result.ok or result.reverted),
            truncated=result.truncated,
            resumed=self.resumed,
            output=result.output if result.ok else None,
            error=await masking.amask(result.error_message) if result.error_message else None,
            approvals=tuple(pending_view(r) for r in hold.requested),
        )
        reason = "turn completed" if result.ok else f"turn failed: {result.status}"
        if parked:
            reason = "turn parked: " + ("escalated" if escalated else "awaiting approval")
        final_state = self._with_reply(final_state, reply)
        # The run's end commits with the turn (one commit): the summary and the hand-off to
        # memory that follow are the session's, not the run's.
        status: RunStatus = "succeeded" if result.ok else _run_status(result.status)
        end = self.trace.take_end(status, output=text, error=result.error)
        if rebuilt:
            version = await self._write(final_state, reason=reason, good=True, trace=end)
            # History was rewritten: the log is built again from the store next turn.
            self.logs.pop(self.key, None)
        else:
            # The turn's messages stand as they are: appended, whatever the history's length.
            fields = ("step", "machine", "runtime")
            update = {name: getattr(final_state, name) for name in fields}
            version = await self.checkpoint(update, reason=reason, good=True, trace=end)
        if result.ok:
            version = await self._summarize(ends.deadline)
            await self._hand_off(text, position)
        # Ends a run whose end did not ride (an unbuffered run, no trace store); else a no-op.
        await self.trace.aend(status, output=text, error=result.error)
        if not ends.reveal:
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

    def _completed_state(
        self, result: LoopResult, hold: ApprovalHold, position: MachinePosition | None
    ) -> tuple[AgentState, bool]:
        """The state of a completed turn, and whether its history was rebuilt: its messages
        are the log itself unless the runtime's corrections had to be dropped from it."""
        # Still waiting for what it waited for (a message that decided nothing), and more.
        requested = (request.id for request in hold.requested)
        awaiting = tuple(dict.fromkeys((*self.state.runtime.awaiting, *requested)))
        runtime = self.state.runtime.model_copy(
            update={"open_turn": None, "open_turn_message": None, "awaiting": awaiting}
        )
        segment = self.log.since(self.turn_start)
        kept = without_corrections(segment)
        update: dict[str, Any] = {
            "step": max(result.next_step, self.state.step),
            "machine": position,
            "runtime": runtime,
        }
        rebuilt = len(kept) != len(segment)
        if rebuilt:
            update["messages"] = [*self.log.messages[: self.turn_start], *kept]
        return self.state.model_copy(update=update), rebuilt

    async def _reverted_state(self, result: LoopResult) -> AgentState:
        """The last good state, with the exchange, the effects, and the failure counted."""
        base = await self._last_good()
        machine, position = self.workflow.machine, base.machine
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

    async def _last_good(self) -> AgentState:
        # Back to the last good checkpoint, keeping the exchange and the failure count.
        last_good = await self.store.alast_good(self.key)
        if last_good is None:
            written = list(self.state.messages[: self.written])
            return self.state.model_copy(update={"messages": written})
        return (await self.store.aat(self.key, last_good.version)).state

    async def fail(
        self, error: KeelError, *, cause: BaseException | None = None, reveal: bool = True
    ) -> AgentReply:
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
        base = await self._last_good()
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
            error=await self.masking.amask(f"{type(error).__name__}: {error}"),
        )
        final_state = self._with_reply(final_state, reply)
        version = await self._write(final_state, reason="turn failed: failed", good=True)
        self.logs.pop(self.key, None)
        shown = await self.masking.areveal(text) if reveal else text
        return reply.model_copy(update={"state_version": version, "text": shown})

    async def close_cancelled(self) -> bool:
        """End the turn its caller cancelled, at the last good state with the user's message,
        the side effects that happened and keel's note that the user cancelled it: no later
        turn finishes it. False when it could not be written (the turn then stays open)."""
        try:
            base = await self._last_good()
            await self._write(
                self._closed_state(base, cancelled_note()), reason="turn cancelled", good=True
            )
        except (ConflictError, StoreError):
            logger.warning("the cancelled turn on session %s stays open", self.key, exc_info=True)
            return False
        finally:
            self.logs.pop(self.key, None)
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
                "tenant_id": self.tenant_id,
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

    async def _summarize(self, deadline: float) -> int:
        """Fold old turns into the running summary after the commit, within the time left,
        and archive it under the session's user; a summary that cannot be finished, archived
        or saved is simply tried again next turn."""
        committed, version = self.state, self.version
        log = self.logs.of(self.key, committed, version)
        appending = log is self.log
        conversation = log.conversation
        remaining = deadline - time.monotonic()
        if not conversation.needs_summary or remaining <= 0:
            return version
        outcome = None
        try:
            async with asyncio.timeout(remaining):
                outcome = await conversation.asummarize()
                if outcome is None or not outcome.committed:
                    return version
                if self.memory is not None:
                    await self.memory.archive(self.session_id, self.user_id, conversation.summary)
        except TimeoutError:
            if outcome is None or not outcome.committed:
                return version
            self.logs.pop(self.key, None)
            return version
        except Exception:
            # Memory is down: the turns stay raw in the store (the conversation, which folded
            # them, is rebuilt from it next time) and the summary is tried again next turn.
            self.logs.pop(self.key, None)
            logger.warning("the summary of session %s was not archived", self.key, exc_info=True)
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
                version = await self.checkpoint({"runtime": runtime}, reason="summary", good=True)
            else:
                summarized = committed.model_copy(update={"runtime": runtime})
                version = await self._write(summarized, reason="summary", good=True)
        except (ConflictError, StoreError):
            # The turn is committed; only its summary is not. The conversation already folded
            # the turns, so it is rebuilt from the store next time.
            self.logs.pop(self.key, None)
            logger.warning("the summary of session %s could not be saved", self.key)
            return version
        log.version = version
        return version

    async def _hand_off(self, reply: str, position: MachinePosition | None) -> None:
        """The committed turn's words to memory, and a workflow run that reached its goal."""
        memory, machine = self.memory, self.workflow.machine
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


@dataclass(frozen=True)
class WriterPolicy:
    """What a turn's writer keeps of the agent: the tenant, the turn's privacy view, the
    workflow, the hand-off to memory (None: no memory)."""

    tenant_id: str
    masking: Masking
    workflow: Workflow
    memory: MemoryHandOff | None


@dataclass(frozen=True)
class TurnEnd:
    """What the runner tells its writer at the end of the turn, besides the loop's result."""

    loop_start: int
    """The log's length when the turn's loop started from it."""
    position: MachinePosition | None
    """The workflow's position as the turn ends."""
    max_prompt_tokens: int
    prompt_limit: int
    deadline: float
    """``time.monotonic()`` by which the summary must be done (the run's time limit)."""
    reveal: bool = True


def _run_status(status: str) -> Any:
    if status in ("step_limit", "time_limit"):
        return "limited"
    if status in ("loop_detected", "tool_in_doubt", "awaiting_approval"):
        # Handed to a person (DESIGN.md, "Turn outcomes").
        return "escalated"
    return "failed"


def is_user_turn(message: Message) -> bool:
    """A message the user wrote (runtime corrections travel as user messages too)."""
    return message.role == "user" and "keel_correction" not in message.metadata


def unanswered_note(status: str) -> Message:
    """What the history keeps of a turn keel ended without an answer: a note in keel's name.
    The user got keel's apology (the reply, the trace); the model is never shown it as its own
    answer, only that the turn got none."""
    return runtime_note(
        f"The turn above ended without an answer from the assistant ({status}); "
        "keel told the user so.",
        reason=status,
    )


def cancelled_note() -> Message:
    """What the history keeps of a turn its user cancelled (Ctrl-C in ``keel chat``): a note in
    keel's name, so the model knows the question above went unanswered on purpose and answers
    the next message, not the cancelled one."""
    return runtime_note(
        "[cancelled] The user cancelled the turn above before the assistant finished its "
        "answer; it stays unanswered unless they ask again.",
        reason="cancelled",
    )


def without_corrections(segment: list[Message]) -> list[Message]:
    """The turn's messages without the runtime's corrective prompts and the unusable replies
    they answered (or, for a request to continue, the part of the answer the final message
    holds whole): scaffolding of the run, not words of the user or answers of the agent."""
    kept: list[Message] = []
    for message in segment:
        if "keel_correction" in message.metadata:
            if kept and kept[-1].role == "assistant" and not kept[-1].tool_calls:
                kept.pop()
            continue
        kept.append(message)
    return kept


def clip(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _rider(batch: TraceBatch | None) -> Rider | None:
    """``batch`` as a rider of the checkpoint's transaction, where its store is SQL (it rides
    only a write on its own database: elsewhere it is written on its own)."""
    if batch is None or not isinstance(batch.store, SQLTraceStore):
        return None
    return batch.store.rider(batch.run, batch.steps, batch.end)


def hand_off(
    memory: Memory | None, vault: Vault | None, tenant_id: str, budget_tokens: int
) -> MemoryHandOff | None:
    """The agent's hand-off to ``memory`` (None without memory). A memory with no vault of
    its own is given the agent's: what is written to it outside the turns (the service's
    memory route, MCP) numbers its values as the turns do, in the user's vault."""
    if memory is None:
        return None
    if memory.vault is None and vault is not None:
        memory.vault = vault
    return MemoryHandOff(memory, tenant_id=tenant_id, budget_tokens=budget_tokens)


class MemoryHandOff:
    """One agent's traffic with its long-term memory, scoped to its tenant: memories recalled
    for a turn's prompt, and after the commit the turn's words, a finished workflow run and
    the session's running summary, each under the session and user the turn names.

    Memory keeps one summary per session, the latest: each running summary restates most of
    the one before (which the prompt held), so storing every one filled memory with copies
    (158 of 166 summaries over a 507-turn ``keel demo``). What a summary drops is in the turns.
    Every write runs as the memory store runs a call for an event loop
    ([`acall`][keel.memory.MemoryStore.acall]: on SQLite inline while no other writer holds
    the lock, else on keel's blocking pool).
    """

    def __init__(self, memory: Memory, *, tenant_id: str, budget_tokens: int) -> None:
        self.memory = memory
        self.tenant_id = tenant_id
        self.budget_tokens = budget_tokens

    def _scope(self, user_id: str) -> Scope:
        return Scope(tenant_id=self.tenant_id, user_id=user_id)

    async def recall(
        self, user_id: str, query: str, shown: ShownSession | None = None
    ) -> list[ContextMemory]:
        """The memories for ``query``, within the budget; none of those ``shown`` (what the
        prompt already holds of its session: its summary, the turns in its window), which
        would spend the budget on copies."""
        if not query.strip() or self.budget_tokens <= 0:
            return []
        packed = await self.memory.aretrieve(
            query,
            scope=self._scope(user_id),
            budget_tokens=self.budget_tokens,
            filters=MemoryFilter(exclude_types=(RUN_TYPE,), shown=shown),
        )
        return [
            ContextMemory(text=item.text, score=item.score, id=",".join(item.record_ids))
            for item in packed.items
        ]

    async def remember_turn(
        self, session_id: str, user_id: str, turn: int, request: str, reply: str
    ) -> None:
        """The turn's words in memory, each with its speaker's provenance: what the user wrote
        is the user's claim; what the model answered is the assistant's, never the user's (a
        model inventing "you live at 1027 Bergen Street" is not the user saying so). Both
        writes (and the memory's masking through the user's vault) are one call of the
        store's and one transaction: on SQLite inline, as the turn's checkpoints are, unless
        another writer holds the lock (then on the bridge's pool)."""
        said: tuple[tuple[str, str, Provenance], ...] = (
            ("user", f"User: {request}", "user_claim"),
            ("assistant", f"Assistant: {reply}", "inferred"),
        )
        entries = [
            {
                "text": text,
                "kind": "episodic",
                "type": "turn",
                "provenance": provenance,
                "session_id": session_id,
                "turn": turn,
                "metadata": {"speaker": speaker},
            }
            for speaker, text, provenance in said
        ]
        # Both records in one transaction: one commit a turn, not one a record.
        await self.memory.aadd_many(entries, scope=self._scope(user_id))

    async def remember_run(
        self, session_id: str, user_id: str, task: str, tool_calls: Sequence[ToolCall]
    ) -> None:
        """A workflow run that reached its goal, to be replayed as an example."""
        if not tool_calls:
            return
        await run_blocking(
            self.memory.remember_run,
            self._scope(user_id),
            task,
            tool_calls,
            succeeded=True,
            session_id=session_id,
        )

    async def archive(self, session_id: str, user_id: str, summary: str) -> None:
        """Keep the session's committed running summary (the turns it folded are there
        already: every turn is remembered as it ends)."""
        if not summary.strip():
            return
        # Under the session's key the new summary replaces the last one in the same
        # transaction, so a retried summary is safe and only the newest is kept.
        await self.memory.aadd(
            summary,
            scope=self._scope(user_id),
            kind="episodic",
            type="summary",
            provenance="inferred",
            session_id=session_id,
            key=f"{SUMMARY_KEY_PREFIX}{session_id}",
        )
