"""The agent: one turn of DESIGN.md's flow, joining state, memory, context, models and tools.

``await agent.handle(session_id, user_id, text)``:

1. load the session's typed state and its workflow position (resume instructions);
2. retrieve long-term memories within their token budget;
3. compile the context (exact budgets, window + summary, pruning; budget report kept);
4. checkpoint BEFORE every model call (compare-and-set on the version read);
5. run the model-and-tools loop (:class:`~keel.runtime.ToolLoop`): validation, repair,
   exactly-once journal, loop detection, step and time limits;
6. apply workflow transitions from the model's structured tool calls (``go_to`` /
   ``remember``), never from regexes on prose, checkpointing after each one;
7. commit the turn (marked good), hand it to memory through the outbox, fold old turns into
   the running summary, and write the trace.

Any failure leaves the session at its last good checkpoint with a clean message for the user;
failures are counted per workflow state and a persistent one moves the machine to its failure
state. A turn interrupted by a crash is finished by :meth:`Agent.resume`, which replays the
journalled tool calls of the interrupted step instead of running them again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from keel.context import (
    CompiledPrompt,
    ContextBudget,
    ContextEngine,
    ContextMemory,
    Conversation,
)
from keel.errors import (
    ConflictError,
    GuardError,
    KeelError,
    UsageError,
)
from keel.guards import GuardConfig, SpiralMonitor
from keel.messages import Message, ToolCall
from keel.models import ChatModel
from keel.privacy import PIIMasker
from keel.runtime._tool_loop import LoopHooks, LoopResult, StepRecord, ToolLoop
from keel.state import AgentState, MachinePosition, StateMachine, StateStore
from keel.tools import Tool, ToolJournal, ToolRegistry, tool
from keel.tracing import RunTrace, Tracer

if TYPE_CHECKING:
    from keel.memory import Memory
    from keel.settings import Settings

__all__ = ["Agent", "AgentReply"]

_UNBOUNDED_STEPS = 1_000_000_000
"""AgentState.max_steps for a session: per-run limits live in GuardConfig."""

_CONFLICT_ATTEMPTS = 3

_SUMMARY_KEY = "context_summary"
_SUMMARIZED_KEY = "context_messages_summarized"
_TURNS_SUMMARIZED_KEY = "context_turns_summarized"
_OPEN_TURN_KEY = "open_turn"
_TURNS_KEY = "turns"
_FINISHED_KEY = "finished_workflows"

_DEFAULT_MASKER = PIIMasker()

_FAILURE_REPLY = (
    "I'm sorry, something went wrong on my side and nothing was changed. Please try again."
)


class AgentReply(BaseModel):
    """What one turn produced, for the caller and for dashboards."""

    model_config = ConfigDict(frozen=True)

    text: str = Field(description="The reply for the user (a clean message when it failed).")
    status: str = Field(description="How the turn ended: completed, or why it stopped.")
    session_id: str = Field(description="The session.")
    run_id: str = Field(description="The trace's run id (``keel runs show RUN``).")
    state_version: int = Field(description="The state version committed at the end of the turn.")
    workflow_state: str | None = Field(
        default=None, description="The state machine's state after the turn, if there is one."
    )
    steps: int = Field(default=0, description="Model calls made in the turn.")
    max_prompt_tokens: int = Field(default=0, description="Largest prompt sent in the turn.")
    prompt_limit: int = Field(default=0, description="Tokens a prompt may take (window - reserve).")
    loops_detected: int = Field(default=0, description="Loop detections in the turn.")
    tool_calls: tuple[str, ...] = Field(default=(), description="Tools called, in order.")
    reverted: bool = Field(default=False, description="State went back to the last good version.")
    resumed: bool = Field(default=False, description="The turn finished one a crash interrupted.")
    error: str | None = Field(default=None, description="The error, when the turn failed.")


@dataclass
class _Session:
    """An in-process cache of one session's incremental conversation."""

    version: int
    messages_seen: int
    conversation: Conversation
    summarized_before: int
    """Messages already folded into the summary when the conversation was rebuilt."""


@dataclass
class _Turn:
    """Mutable facts of the turn in flight, shared with the loop's hooks and workflow tools."""

    session_id: str
    user_id: str
    state: AgentState
    version: int
    base_messages: int
    added_to_conversation: int
    conversation: Conversation
    memories: list[ContextMemory]
    position: MachinePosition | None
    run: RunTrace
    last_prompt: CompiledPrompt | None = None
    max_prompt_tokens: int = 0
    shrink_next: bool = False
    transitions: list[tuple[str, str]] = field(default_factory=list)
    position_checkpointed: MachinePosition | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)


class Agent:
    """A resilient agent: typed state, memory, bounded context, validated tools, traces.

    Args:
        model: the chat model.
        state: the state store (``StateStore(backend, AgentState)``); every write is
            compare-and-set on the version read.
        system_prompt: identity and guardrails; always message 0 of every prompt.
        tools: the domain tools.
        rules: operating rules placed last, before the newest user message.
        machine: an optional workflow; the model moves it with the ``go_to`` and
            ``remember`` tools, and only the current state's tools may run.
        memory: optional long-term memory (retrieved each turn, written through its outbox).
        journal: the exactly-once journal for side-effecting tools (same database as state).
        tracer: where runs and steps are recorded.
        context: how the window is shared out (default: whole window, 12% answer reserve).
        guards: step and time limits, loop thresholds (defaults: the seed values).
        memory_budget_tokens: tokens retrieved memories may take.
        masker: masks PII and secrets in every message at the door (user text, tool results,
            model output), so prompts, checkpoints, memory and traces only ever hold
            placeholders like ``<EMAIL_1>``. ``None`` turns masking off, explicitly.
        tenant_id: the tenant every memory read and write is scoped to.
        name: the agent's name in traces and death-spiral indicators.
    """

    def __init__(
        self,
        model: ChatModel,
        *,
        state: StateStore[AgentState],
        system_prompt: str,
        tools: Sequence[Tool] = (),
        rules: Sequence[str] = (),
        machine: StateMachine | None = None,
        memory: Memory | None = None,
        journal: ToolJournal | None = None,
        tracer: Tracer | None = None,
        context: ContextBudget | None = None,
        guards: GuardConfig | None = None,
        memory_budget_tokens: int = 800,
        masker: PIIMasker | None = _DEFAULT_MASKER,
        tenant_id: str = "default",
        name: str = "agent",
    ) -> None:
        if not system_prompt.strip():
            raise UsageError("an agent needs a system prompt")
        self.model = model
        self.state = state
        self.system_prompt = system_prompt
        self.rules = tuple(rules)
        self.machine = machine
        self.memory = memory
        self.journal = journal
        self.tracer = tracer or Tracer(None, agent=name)
        self.guards = guards or GuardConfig()
        self.memory_budget_tokens = memory_budget_tokens
        self.masker = masker
        self.tenant_id = tenant_id
        self.name = name
        self.monitor = SpiralMonitor()
        self._users: dict[str, str] = {}
        self.engine = ContextEngine(
            model,
            budget=context,
            memory_sink=_MemoryArchive(self) if memory is not None else None,
        )
        self._shrunk_engine: ContextEngine | None = None
        self._domain_tools = {t.name: t for t in tools}
        clash = set(self._domain_tools) & {"go_to", "remember"}
        if machine is not None and clash:
            raise UsageError(f"tool names {sorted(clash)} are reserved for the workflow")
        self._sessions: dict[str, _Session] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._owned: list[Callable[[], None]] = []

    # --- construction ---------------------------------------------------------------------------

    @classmethod
    def embedded(
        cls,
        model: ChatModel | str | None = None,
        *,
        system_prompt: str,
        tools: Sequence[Tool] = (),
        rules: Sequence[str] = (),
        machine: StateMachine | None = None,
        memory: bool = True,
        settings: Settings | None = None,
        **options: Any,
    ) -> Agent:
        """An agent on the embedded default: one SQLite file holds state, the tool journal,
        traces and memory; the model is a spec (default: ``settings.model``) or a ChatModel.

        ``options`` are passed to the constructor (``context=``, ``guards=``, ...). Close the
        agent with :meth:`aclose` (or ``close``) to flush memory and release the database.
        """
        from keel.memory import Memory, embedder_from_settings
        from keel.models import resolve_model
        from keel.privacy import mask_pii
        from keel.settings import load_settings
        from keel.stores import (
            SQLiteMemoryStore,
            SQLiteStateBackend,
            SQLiteToolJournal,
            open_database,
        )
        from keel.stores._sqlite_traces import SQLiteTraceStore

        settings = settings or load_settings()
        database = open_database(settings)
        traces = SQLiteTraceStore(database)
        traces.setup()
        chat_model = (
            model
            if isinstance(model, ChatModel)
            else resolve_model(model or settings.model, settings=settings)
        )
        long_term = (
            Memory(
                SQLiteMemoryStore(database),
                embedder=embedder_from_settings(settings),
                background=True,
            )
            if memory
            else None
        )
        agent = cls(
            chat_model,
            state=StateStore(SQLiteStateBackend(database), AgentState),
            system_prompt=system_prompt,
            tools=tools,
            rules=rules,
            machine=machine,
            memory=long_term,
            journal=SQLiteToolJournal(database),
            tracer=Tracer(
                traces,
                redact=mask_pii,
                agent=options.get("name", "agent"),
                # A run killed mid-turn reads as abandoned once silent past this limit.
                run_time_limit_s=(options.get("guards") or GuardConfig()).run_timeout_s,
            ),
            **options,
        )
        agent._owned.append(database.close)
        if long_term is not None:
            agent._owned.insert(0, long_term.close)
        return agent

    async def aclose(self) -> None:
        """Flush memory's outbox and release what :meth:`embedded` opened."""
        while self._owned:
            await asyncio.to_thread(self._owned.pop(0))

    def close(self) -> None:
        """Sync twin of :meth:`aclose`."""
        while self._owned:
            self._owned.pop(0)()

    # --- public API ---------------------------------------------------------------------------

    @property
    def prompt_limit(self) -> int:
        """Tokens a compiled prompt may take (window, or working budget, minus the reserve)."""
        return self.engine.budget.limit

    async def handle(self, session_id: str, user_id: str, text: str) -> AgentReply:
        """Process one user message and return the reply (never raises for run failures).

        Raises:
            UsageError: empty ids or message.
            StoreError: the state store itself is unavailable.
        """
        if not session_id or not user_id:
            raise UsageError("session_id and user_id must not be empty")
        if not text.strip():
            raise UsageError("the user message is empty")
        async with self._lock(session_id):
            for attempt in range(_CONFLICT_ATTEMPTS):
                try:
                    return await self._turn(session_id, user_id, text, resume=False)
                except ConflictError:
                    # Another writer committed first: forget the cached view, re-read, redo.
                    self._sessions.pop(session_id, None)
                    if attempt == _CONFLICT_ATTEMPTS - 1:
                        raise
            raise AssertionError("unreachable")

    def handle_sync(self, session_id: str, user_id: str, text: str) -> AgentReply:
        """Sync twin of :meth:`handle` (not for use inside a running event loop)."""
        return asyncio.run(self.handle(session_id, user_id, text))

    async def resume(self, session_id: str, user_id: str) -> AgentReply | None:
        """Finish a turn that a crash interrupted; None when the session has no open turn."""
        async with self._lock(session_id):
            checkpoint = await self.state.aget(session_id)
            if checkpoint is None or not checkpoint.state.data.get(_OPEN_TURN_KEY):
                return None
            return await self._turn(session_id, user_id, "", resume=True)

    def session_state(self, session_id: str) -> AgentState | None:
        """The session's committed state, or None."""
        checkpoint = self.state.get(session_id)
        return None if checkpoint is None else checkpoint.state

    # --- one turn -----------------------------------------------------------------------------

    def _lock(self, session_id: str) -> asyncio.Lock:
        lock = self._locks.get(session_id)
        if lock is None:
            lock = self._locks[session_id] = asyncio.Lock()
        return lock

    async def _load(self, session_id: str) -> tuple[AgentState, int]:
        checkpoint = await self.state.aget(session_id)
        if checkpoint is None:
            initial = AgentState(
                max_steps=_UNBOUNDED_STEPS,
                machine=self.machine.start() if self.machine is not None else None,
            )
            checkpoint = await self.state.acreate(session_id, initial)
            await self.state.amark(session_id, checkpoint.version, good=True)
        return checkpoint.state, checkpoint.version

    def _conversation(self, session_id: str, state: AgentState, version: int) -> Conversation:
        cached = self._sessions.get(session_id)
        if cached is not None and cached.version == version:
            return cached.conversation
        summarized = int(state.data.get(_SUMMARIZED_KEY, 0))
        conversation = self.engine.conversation(
            session_id,
            state.messages[summarized:],
            summary=str(state.data.get(_SUMMARY_KEY, "")),
            turns_summarized=int(state.data.get(_TURNS_SUMMARIZED_KEY, 0)),
        )
        self._sessions[session_id] = _Session(
            version, len(state.messages), conversation, summarized
        )
        return conversation

    async def _memories(self, user_id: str, query: str) -> list[ContextMemory]:
        if self.memory is None or not query.strip() or self.memory_budget_tokens <= 0:
            return []
        from keel.memory import Scope

        packed = await self.memory.aretrieve(
            query,
            scope=Scope(tenant_id=self.tenant_id, user_id=user_id),
            budget_tokens=self.memory_budget_tokens,
        )
        return [
            ContextMemory(text=item.text, score=item.score, id=",".join(item.record_ids))
            for item in packed.items
        ]

    async def _turn(self, session_id: str, user_id: str, text: str, *, resume: bool) -> AgentReply:
        self._users[session_id] = user_id
        state, version = await self._load(session_id)
        position = state.machine
        data = dict(state.data)
        if position is not None and self.machine is not None and self.machine.is_terminal(position):
            # A finished workflow instance: the next message starts a new one.
            finished = [*data.get(_FINISHED_KEY, []), position.model_dump(mode="json")]
            data[_FINISHED_KEY] = finished[-20:]
            position = self.machine.start()
        messages = list(state.messages)
        if not resume:
            turn_number = int(data.get(_TURNS_KEY, 0)) + 1
            data[_TURNS_KEY] = turn_number
            text = self._mask(text)
            messages.append(Message.user(text, metadata={"turn": turn_number}))
        else:
            text = next((m.content for m in reversed(messages) if m.role == "user"), "")
        data[_OPEN_TURN_KEY] = True
        state = state.model_copy(update={"messages": messages, "machine": position, "data": data})
        conversation = self._conversation(session_id, state, version)
        seen = self._sessions[session_id].messages_seen
        conversation.extend(messages[seen:])
        self._sessions[session_id].messages_seen = len(messages)

        run = await self.tracer.astart_run(
            session_id,
            user_id=user_id,
            tenant_id=self.tenant_id,
            agent=self.name,
            input=text,
            attributes={"resumed": resume},
        )
        turn = _Turn(
            session_id=session_id,
            user_id=user_id,
            state=state,
            version=version,
            base_messages=len(messages),
            added_to_conversation=len(messages),
            conversation=conversation,
            memories=await self._memories(user_id, text),
            position=position,
            run=run,
            position_checkpointed=position,
        )
        loop = ToolLoop(
            self.model,
            self._registry(turn),
            guards=self.guards,
            journal=self.journal,
            hooks=LoopHooks(
                before_model_call=lambda step, history: self._before_model_call(
                    turn, step, history
                ),
                after_step=lambda record: self._after_step(turn, record),
                state_fingerprint=lambda: self._fingerprint(turn),
                revert_to_last_good=lambda error: self._on_guard_stop(turn, error),
            ),
            monitor=self.monitor,
            agent=self.name,
        )
        try:
            result = await loop.arun(messages, session_id=session_id, first_step=state.step)
        except ConflictError:
            await run.aend("failed", error=None, output="state conflict; retried")
            raise
        except KeelError as exc:
            await run.aend(error=exc)
            return await self._fail(turn, exc)
        return await self._commit(turn, result, resume=resume)

    def _note_commit(self, session_id: str, version: int, messages: int | None = None) -> None:
        """Keep the cached conversation valid for the version this process just wrote."""
        session = self._sessions.get(session_id)
        if session is not None:
            session.version = version
            if messages is not None:
                session.messages_seen = messages

    def _engine_for(self, turn: _Turn) -> ContextEngine:
        if not turn.shrink_next:
            return self.engine
        if self._shrunk_engine is None:
            # The provider said the prompt was too long: our count and theirs disagree (a
            # template or tokenizer we could only estimate). Try again with a third less room.
            limit = max(1024, int(self.engine.budget.limit * 2 / 3))
            self._shrunk_engine = ContextEngine(
                self.model,
                budget=self.engine.budget_config.model_copy(update={"working_budget": limit}),
            )
        return self._shrunk_engine

    def _rules(self, turn: _Turn) -> list[str]:
        rules = list(self.rules)
        if self.machine is not None and turn.position is not None:
            rules.append(self.machine.resume_prompt(turn.position))
            allowed = set(self.machine.tools(turn.position))
            banned = sorted(name for name in self._domain_tools if name not in allowed)
            if banned:
                rules.append(f"Do not call these tools in this step: {', '.join(banned)}.")
            rules.append(
                "To record a detail the user gave, call remember(slot, value). To move the "
                "workflow on, call go_to(step) with one of the possible next steps."
            )
        return rules

    async def _before_model_call(
        self, turn: _Turn, step: int, history: list[Message]
    ) -> list[Message]:
        new = [self._mask_message(m) for m in history[turn.added_to_conversation :]]
        turn.conversation.extend(new)
        messages = [*turn.state.messages[: turn.added_to_conversation], *new]
        turn.added_to_conversation = len(history)
        state = turn.state.model_copy(
            update={
                "messages": messages,
                "step": step,
                "machine": turn.position,
            }
        )
        # The checkpoint before the model call: compare-and-set on the version we read.
        turn.version = await self.state.acheckpoint(
            turn.session_id,
            state,
            expected_version=turn.version,
            reason="before model call",
            step=step,
        )
        turn.state = state
        self._note_commit(turn.session_id, turn.version, len(messages))
        prompt = self._engine_for(turn).compile(
            turn.conversation,
            system=self.system_prompt,
            rules=self._rules(turn),
            memories=turn.memories,
            tools=self._registry(turn).schemas(),
        )
        turn.shrink_next = False
        turn.last_prompt = prompt
        turn.max_prompt_tokens = max(turn.max_prompt_tokens, prompt.tokens)
        return list(prompt.messages)

    async def _after_step(self, turn: _Turn, record: StepRecord) -> None:
        if record.error_type == "ContextLengthExceededError":
            turn.shrink_next = True
        report = turn.last_prompt.report.model_dump(mode="json") if turn.last_prompt else None
        model_step = await turn.run.arecord(
            "model",
            record.model or self.model.spec,
            usage=record.usage,
            model=record.model or self.model.spec,
            finish_reason=record.finish_reason,
            budget=report,
            state_version=turn.version,
            raw_output=record.raw_output,
            parsed_action={
                "action": record.action,
                "tool_calls": [
                    {"name": r.tool, "arguments": r.raw_arguments} for r in record.tool_results
                ],
                "replayed": record.replayed_decision,
            },
            error_type=record.error_type,
            error_message=record.error,
            latency_ms=record.model_latency_ms,
            ttft_ms=record.ttft_ms,
            attributes={"step": record.step, "guard_events": list(record.guard_events)},
        )
        parent = model_step.step_id if model_step is not None else None
        for result in record.tool_results:
            await turn.run.arecord(
                "tool",
                result.tool,
                parent=parent,
                tool_name=result.tool,
                tool_call_id=result.call_id,
                tool_arguments=result.raw_arguments,
                tool_result=result.output_text if result.ok else None,
                error_type=result.error_type,
                error_message=result.error,
                latency_ms=result.latency_ms,
                attributes={
                    "repairs": list(result.repairs),
                    "replayed": result.replayed,
                    "truncated_for_model": result.truncated,
                },
            )
            if result.ok and result.tool not in ("go_to", "remember"):
                turn.tool_calls.append(
                    ToolCall(id=result.call_id, name=result.tool, arguments=result.raw_arguments)
                )
        for event in record.guard_events:
            if event.startswith("loop"):
                await turn.run.arecord("guard", "loop", parent=parent, error_message=event)
        for source, target in turn.transitions:
            await turn.run.arecord(
                "transition",
                f"{source}->{target}",
                parent=parent,
                attributes={"source": source, "target": target},
            )
        turn.transitions.clear()
        if turn.position != turn.position_checkpointed:
            # A checkpoint after every transition (and slot gathered).
            state = turn.state.model_copy(update={"machine": turn.position})
            turn.version = await self.state.acheckpoint(
                turn.session_id,
                state,
                expected_version=turn.version,
                reason="after transition",
                step=record.step,
            )
            turn.state = state
            turn.position_checkpointed = turn.position
            self._note_commit(turn.session_id, turn.version)

    def _mask(self, text: str) -> str:
        if self.masker is None or not text:
            return text
        return self.masker.mask_text(text, tenant_id=self.tenant_id)

    def _mask_message(self, message: Message) -> Message:
        if self.masker is None:
            return message
        content = self._mask(message.content)
        calls = tuple(
            call.model_copy(update={"arguments": self._mask(call.arguments)})
            for call in message.tool_calls
        )
        if content == message.content and calls == message.tool_calls:
            return message
        return message.model_copy(update={"content": content, "tool_calls": calls})

    def _fingerprint(self, turn: _Turn) -> str:
        position = turn.position.model_dump_json() if turn.position is not None else ""
        return hashlib.sha256(position.encode()).hexdigest()[:16]

    async def _on_guard_stop(self, turn: _Turn, error: GuardError) -> None:
        await turn.run.arecord(
            "guard", type(error).__name__, error_type=type(error).__name__, error_message=str(error)
        )

    # --- ending a turn ------------------------------------------------------------------------

    async def _commit(self, turn: _Turn, result: LoopResult, *, resume: bool) -> AgentReply:
        new = [self._mask_message(m) for m in result.messages[turn.added_to_conversation :]]
        messages = [*turn.state.messages[: turn.added_to_conversation], *new]
        turn.conversation.extend(new)
        position = turn.position
        data = dict(turn.state.data)
        data[_OPEN_TURN_KEY] = False
        reverted = False
        status = result.status
        if result.ok:
            final_state = turn.state.model_copy(
                update={
                    "messages": messages,
                    "step": max(result.next_step, turn.state.step),
                    "machine": position,
                    "data": data,
                }
            )
        else:
            # Back to the last good checkpoint, keeping the exchange and the failure count.
            reverted = True
            # turn.state is what was last checkpointed: the fallback needs no read.
            last_good = await self.state.alast_good(turn.session_id)
            base = (
                (await self.state.aat(turn.session_id, last_good.version)).state
                if last_good is not None
                else turn.state
            )
            position = base.machine
            if self.machine is not None and position is not None:
                before = position.state
                position = self.machine.record_failure(position, status)
                if position.state != before:
                    await turn.run.arecord(
                        "reset", "reset", error_message=position.failure_reason or status
                    )
            user = [m for m in messages[turn.base_messages - 1 :] if m.role == "user"][:1]
            kept = list(base.messages) + user + [result.final_message]
            base_data = dict(base.data)
            base_data.update({_TURNS_KEY: data.get(_TURNS_KEY, 0), _OPEN_TURN_KEY: False})
            final_state = base.model_copy(
                update={
                    "messages": kept,
                    "step": max(result.next_step, turn.state.step),
                    "machine": position,
                    "data": base_data,
                }
            )
            self._sessions.pop(turn.session_id, None)
        if (
            result.ok
            and self.machine is not None
            and position is not None
            and self.machine.is_terminal(position)
            and position.state != self.machine.failure
        ):
            await self._remember_run(turn)
        summary_data = await self._summarize(turn) if result.ok else {}
        if summary_data:
            final_state = final_state.model_copy(
                update={"data": {**final_state.data, **summary_data}}
            )
        version = await self.state.acheckpoint(
            turn.session_id,
            final_state,
            expected_version=turn.version,
            reason="turn completed" if result.ok else f"turn failed: {status}",
            good=True,
        )
        self._note_commit(turn.session_id, version, len(final_state.messages))
        if self.memory is not None and result.ok:
            self._remember_turn(turn, result)
        await turn.run.aend(
            "succeeded" if result.ok else _run_status(status),
            output=result.text,
            error=result.error,
        )
        return AgentReply(
            text=result.text,
            status=status,
            session_id=turn.session_id,
            run_id=turn.run.run_id,
            state_version=version,
            workflow_state=position.state if position is not None else None,
            steps=len(result.steps),
            max_prompt_tokens=turn.max_prompt_tokens,
            prompt_limit=self.prompt_limit,
            loops_detected=result.loops_detected,
            tool_calls=tuple(r.tool for step in result.steps for r in step.tool_results),
            reverted=reverted or result.reverted,
            resumed=resume,
            error=result.error_message,
        )

    async def _fail(self, turn: _Turn, error: KeelError) -> AgentReply:
        """A failure outside the loop's own handling: keep the last good state."""
        self._sessions.pop(turn.session_id, None)
        last_good = await self.state.alast_good(turn.session_id)
        version = turn.version
        if last_good is not None and last_good.version != turn.version:
            reverted = await self.state.arevert(
                turn.session_id, expected_version=turn.version, to_version=last_good.version
            )
            version = reverted.version
        return AgentReply(
            text=_FAILURE_REPLY,
            status="failed",
            session_id=turn.session_id,
            run_id=turn.run.run_id,
            state_version=version,
            workflow_state=turn.position.state if turn.position is not None else None,
            reverted=True,
            error=f"{type(error).__name__}: {error}",
        )

    async def _summarize(self, turn: _Turn) -> dict[str, Any]:
        conversation = turn.conversation
        if not conversation.needs_summary:
            return {}
        outcome = await conversation.asummarize()
        if outcome is None:
            return {}
        session = self._sessions.get(turn.session_id)
        before = session.summarized_before if session is not None else 0
        return {
            _SUMMARY_KEY: conversation.summary,
            _SUMMARIZED_KEY: before + conversation.messages_summarized,
            _TURNS_SUMMARIZED_KEY: conversation.turns_summarized,
        }

    def _remember_turn(self, turn: _Turn, result: LoopResult) -> None:
        from keel.memory import Scope

        assert self.memory is not None
        user_text = next((m.content for m in reversed(turn.state.messages) if m.role == "user"), "")
        turn_number = int(turn.state.data.get(_TURNS_KEY, 0))
        self.memory.add(
            f"User: {user_text}\nAssistant: {result.text}",
            scope=Scope(tenant_id=self.tenant_id, user_id=turn.user_id),
            kind="episodic",
            type="turn",
            session_id=turn.session_id,
            turn=turn_number,
        )

    async def _remember_run(self, turn: _Turn) -> None:
        if self.memory is None or not turn.tool_calls:
            return
        from keel.memory import Scope

        task = next((m.content for m in turn.state.messages if m.role == "user"), "")
        self.memory.remember_run(
            Scope(tenant_id=self.tenant_id, user_id=turn.user_id),
            task,
            turn.tool_calls,
            succeeded=True,
            session_id=turn.session_id,
        )

    # --- tools ----------------------------------------------------------------------------

    def _registry(self, turn: _Turn) -> ToolRegistry:
        registry = ToolRegistry()
        for domain_tool in self._domain_tools.values():
            registry.register(self._gated(turn, domain_tool))
        if self.machine is not None:
            for workflow_tool in self._workflow_tools(turn):
                registry.register(workflow_tool)
        return registry

    def _gated(self, turn: _Turn, domain_tool: Tool) -> Tool:
        """The tool, refusing to run outside the workflow states that allow it."""
        if self.machine is None:
            return domain_tool
        machine = self.machine
        original = domain_tool.ainvoke

        async def gated(**kwargs: Any) -> Any:
            position = turn.position
            if position is not None and domain_tool.name not in machine.tools(position):
                allowed = ", ".join(machine.tools(position)) or "none"
                raise UsageError(
                    f"{domain_tool.name} is not allowed in step {position.state!r} "
                    f"(allowed: {allowed}); move the workflow on with go_to first"
                )
            arguments = domain_tool.args_model.model_validate(
                {k: v for k, v in kwargs.items() if k != domain_tool.context_parameter}
            )
            context = kwargs.get(domain_tool.context_parameter or "")
            return await original(arguments, context)

        return dataclasses.replace(domain_tool, function=gated)

    def _workflow_tools(self, turn: _Turn) -> list[Tool]:
        machine = self.machine
        assert machine is not None

        def go_to(step: str) -> str:
            """Move the workflow to its next step.

            Args:
                step: One of the possible next steps listed in the instructions.
            """
            position = turn.position or machine.start()
            moved = machine.transition(position, step)
            turn.transitions.append((position.state, moved.state))
            turn.position = moved
            return json.dumps({"step": moved.state, "next": machine.allowed(moved)})

        def remember(slot: str, value: str) -> str:
            """Record a detail the user gave (origin, destination, dates, passengers, ...).

            Args:
                slot: The name of the detail.
                value: Its value, as the user gave it.
            """
            position = turn.position or machine.start()
            turn.position = machine.fill(position, **{slot: value})
            return json.dumps({"remembered": {slot: value}})

        return [tool(go_to), tool(remember)]


class _MemoryArchive:
    """The context engine's :class:`~keel.context.MemorySink`: committed summaries go to
    long-term memory (the evicted turns are there already: every turn is remembered as it ends).
    """

    def __init__(self, agent: Agent) -> None:
        self._agent = agent

    async def archive(self, session_id: str, evicted: Sequence[Message], summary: str) -> None:
        memory = self._agent.memory
        user_id = self._agent._users.get(session_id)
        if memory is None or user_id is None or not summary.strip():
            return
        from keel.memory import Scope

        # Adding the same summary twice is a no-op in memory, so a retried summary is safe.
        await asyncio.to_thread(
            memory.add,
            summary,
            scope=Scope(tenant_id=self._agent.tenant_id, user_id=user_id),
            kind="episodic",
            type="summary",
            provenance="inferred",
            session_id=session_id,
        )


def _run_status(status: str) -> Any:
    if status in ("step_limit", "time_limit"):
        return "limited"
    if status in ("loop_detected", "tool_in_doubt"):
        return "escalated"
    return "failed"
