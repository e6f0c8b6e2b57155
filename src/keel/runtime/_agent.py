"""The agent: one turn of DESIGN.md's flow, joining state, memory, context, models and tools.

``await agent.handle(session_id, user_id, text)``:

1. own the session: take its lease in the state store (across threads, event loops and
   processes), renewed while the turn runs; every write is still compare-and-set (fencing);
2. load the session's typed state, keyed by (tenant, session) and owned by one user; a turn
   that a crash left open is finished first;
3. retrieve long-term memories within their token budget;
4. compile the context (exact budgets, window + summary, pruning; budget report kept);
5. checkpoint BEFORE every model call (compare-and-set on the version read);
6. run the model-and-tools loop (:class:`~keel.runtime.ToolLoop`): validation, repair,
   exactly-once journal (keys unique to the turn), loop detection, step and time limits;
7. apply workflow transitions from the model's structured tool calls (``go_to`` /
   ``remember``), never from regexes on prose, checkpointing after each one;
8. commit the turn (marked good), then fold old turns into the running summary, hand the turn
   to memory through the outbox, and write the trace; all within the run's time limit.

Any failure leaves the session at its last good checkpoint with a clean message for the user,
except that side effects that happened stay in the history (reverting never hides a booking).
Failures are counted per workflow state and a persistent one moves the machine to its failure
state. A turn interrupted by a crash is finished by :meth:`Agent.resume`, or by the next
``handle`` on the session before it handles the new message, replaying the journalled tool
calls of the interrupted step instead of running them again.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import re
import time
import unicodedata
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import quote

from keel._bridge import iterate_sync, run_sync
from keel.context import (
    CompiledPrompt,
    ContextBudget,
    ContextEngine,
    ContextMemory,
    runtime_note,
)
from keel.errors import (
    AccessDeniedError,
    ConflictError,
    GuardError,
    KeelError,
    SessionBusyError,
    StoreError,
    TurnInterruptedError,
    UsageError,
)
from keel.guards import GuardConfig, SpiralMonitor, output_json_schema
from keel.messages import Message, ToolCall
from keel.models import ChatModel, ModelOptions, resolve_model
from keel.privacy import DEFAULT_MASKER, PIIMasker, StreamMasker
from keel.runtime._backends import Backends, open_at_edge
from keel.runtime._events import (
    AgentEvent,
    CheckpointCommitted,
    GuardWarning,
    TextDelta,
    TextDiscarded,
    ToolCallFinished,
    ToolCallStarted,
    TurnFinished,
    WorkflowTransition,
)
from keel.runtime._log import SessionLog
from keel.runtime._reply import AgentReply
from keel.runtime._tool_loop import LoopHooks, LoopResult, StepRecord, ToolLoop
from keel.settings import Settings, load_settings
from keel.state import (
    AgentState,
    Checkpoint,
    MachinePosition,
    SessionLock,
    SessionRuntime,
    StateMachine,
    StateStore,
)
from keel.tools import (
    InMemoryJournal,
    Tool,
    ToolJournal,
    ToolRegistry,
    ToolResult,
    ToolScope,
    tool,
)
from keel.tracing import RunTrace, Tracer, arecord_loop_step, redact_json

if TYPE_CHECKING:
    from keel.memory import Memory, Provenance

__all__ = ["Agent", "AgentReply"]

logger = logging.getLogger("keel.runtime")

K = TypeVar("K")
V = TypeVar("V")

_UNBOUNDED_STEPS = 1_000_000_000
"""AgentState.max_steps for a session: per-run limits live in GuardConfig."""

_CLOSE_FLUSH_S = 10.0
"""How long closing an agent waits for memory to embed what its turns wrote."""
_FINISHED_KEPT = 20
_REPLIES_KEPT = 16
"""Replies kept for turns that came with the caller's own turn id (retries come within minutes)."""
_WORKFLOW_TOOLS = ("go_to", "remember")

_DEFAULT_MASKER = DEFAULT_MASKER

_FAILURE_REPLY = (
    "I'm sorry, something went wrong on my side and nothing was changed. Please try again."
)

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class _RunExtras:
    """What one ``run`` / ``stream`` call sets for its turn only."""

    deps: Any = None
    output_type: type[Any] | None = None
    model_options: ModelOptions | None = None
    turn_id: str | None = None


@dataclass
class _Turn:
    """Mutable facts of the turn in flight, shared with the loop's hooks and workflow tools."""

    key: str
    session_id: str
    user_id: str
    turn_id: str
    user_message: Message
    turn_start: int
    """Index of the turn's user message in the state's messages."""
    state: AgentState
    """The turn's state as of its last checkpoint, except ``messages``: while the turn appends
    to the log, that is the log itself (see ``written``)."""
    version: int
    log: SessionLog
    written: int
    """Messages of the log the checkpoint at ``version`` holds: the rest are the next append."""
    memories: list[ContextMemory]
    position: MachinePosition | None
    run: RunTrace
    deadline: float
    lease: _Lease
    registry: ToolRegistry | None = None
    loop_start: int = 0
    """The log's length when the turn's loop started from it."""
    last_prompt: CompiledPrompt | None = None
    last_headroom: int = 0
    """Tokens the last prompt left free beyond the reserve (see ``Agent._headroom``)."""
    max_prompt_tokens: int = 0
    shrink_next: bool = False
    committed: bool = False
    """Whether any checkpoint of this turn was written (a conflict then leaves it open)."""
    transitions: list[tuple[str, str]] = field(default_factory=list)
    position_checkpointed: MachinePosition | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    effects: list[tuple[ToolCall, Message]] = field(default_factory=list)
    """Side-effecting calls that ran, were replayed or are in doubt, with their results."""
    emit: Callable[[AgentEvent], None] | None = None
    """Where a streamed turn's events go (None: the turn is not streamed)."""
    deps: Any = None
    output_type: type[Any] | None = None
    model_options: ModelOptions = field(default_factory=ModelOptions)
    record_reply: bool = False
    """The caller gave the turn its id: its reply is committed with it, for retries."""
    streamed_text: dict[int, StreamMasker | None] = field(default_factory=dict)
    """The steps whose reply text streamed: the masker of each (None: masking is off, the
    text went out as it came)."""
    shown_steps: set[int] = field(default_factory=set)
    """Steps whose reply text reached the caller (in part, at least)."""
    continued_steps: list[int] = field(default_factory=list)
    """Streamed steps whose answer was cut and is being continued (their text stands only if
    the answer is finished)."""

    def remaining(self) -> float:
        return self.deadline - time.monotonic()


class _Recent(OrderedDict[K, V]):
    """A dict that keeps its ``size`` most recently written (or moved) keys."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def __setitem__(self, key: K, value: V) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.size:
            self.popitem(last=False)


class _Lease:
    """This turn's ownership of a session: the store's lease, renewed in the background.

    The lease keeps well-behaved writers apart across threads and processes; correctness does
    not rest on it: every write is compare-and-set, and before each side effect the lease is
    renewed so a worker that stalled past it never acts on a session another one took over.
    """

    def __init__(self, lock: SessionLock, session_id: str) -> None:
        self.lock = lock
        self.session_id = session_id
        self.lost = False
        self._ended = asyncio.Event()

    async def heartbeat(self) -> None:
        """Renew the lease every third of its time to live until :meth:`end`."""
        period = max(self.lock.ttl / 3, 0.05)
        while not self.lost:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._ended.wait(), period)
            # Checked after every await, not left to cancellation alone: a client library
            # can swallow a cancel that lands mid-command (asyncio.wait_for before Python
            # 3.12 drops one that races the inner result), and this loop would renew the
            # lease forever while the turn waits for it to stop.
            if self._ended.is_set():
                return
            try:
                if not await self.lock.aacquire(0):
                    self.lost = True
            except StoreError:
                logger.warning("could not renew the lease on session %s", self.session_id)

    async def end(self, heartbeat: asyncio.Task[None]) -> None:
        """Stop renewing: the turn is over."""
        self._ended.set()
        heartbeat.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await heartbeat

    async def check(self) -> None:
        """Renew now; raise when another owner has taken the session."""
        if not self.lost:
            try:
                self.lost = not await self.lock.aacquire(0)
            except StoreError as exc:
                raise TurnInterruptedError(
                    self.session_id, "its lease could not be renewed"
                ) from exc
        if self.lost:
            raise TurnInterruptedError(self.session_id, "another worker took its lease")


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
        guards: step and time limits, loop thresholds (defaults: the seed values). The run
            time limit covers the whole turn: memory retrieval, the loop, commit and summary.
        memory_budget_tokens: tokens retrieved memories may take.
        masker: masks PII and secrets in every message at the door (user text, tool results,
            model output), so prompts, checkpoints, memory and traces only ever hold
            placeholders like ``<EMAIL_1>``. ``None`` turns masking off, explicitly.
        tenant_id: the tenant every session, journal entry, trace and memory is scoped to.
        name: the agent's name in traces and death-spiral indicators.
        lease_ttl_s: how long a turn's lease on its session lasts without renewal (it is
            renewed every third of that while the turn runs). A lease whose holder died on
            this machine is taken over at once; one held elsewhere frees when it expires.
        session_wait_s: how long a turn waits for a session another turn holds before it
            gives up with :class:`~keel.errors.SessionBusyError` (default: the lease's time
            to live and 5 s, so a crashed holder's lease can expire).
        session_cache_size: how many sessions' incremental conversations this process keeps
            (least recently used go first; an evicted session is rebuilt from the store).
        output_type: the type of the final answer (a Pydantic model, a TypedDict...): the
            model answers with one JSON object, validated, each wrong field sent back for it to
            correct (``guards.max_output_retries`` times); ``reply.output`` is the value.
            ``run`` and ``stream`` can override it per turn.
        model_options: generation options for every model call (``max_tokens``,
            ``temperature``, ``stop``, ``seed``...); ``run`` and ``stream`` can override
            them per turn. Without ``max_tokens`` a model call may generate what the window
            leaves after its prompt (never less than the context's answer reserve, which no
            prompt takes; at most the model's output limit); with it, at most that. An
            answer cut at the limit is continued (``reply.truncated`` when it cannot be).
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
        lease_ttl_s: float = 10.0,
        session_wait_s: float | None = None,
        session_cache_size: int = 256,
        output_type: type[Any] | None = None,
        model_options: ModelOptions | None = None,
    ) -> None:
        if not isinstance(system_prompt, str) or not system_prompt.strip():
            raise UsageError("an agent needs a system prompt")
        _require_id("tenant_id", tenant_id)
        if lease_ttl_s <= 0:
            raise UsageError(f"lease_ttl_s must be positive, got {lease_ttl_s}")
        if session_cache_size < 1:
            raise UsageError(f"session_cache_size must be >= 1, got {session_cache_size}")
        self.model = model
        self.state = state
        self.system_prompt = system_prompt
        self.output_type = output_type
        self.model_options = model_options or ModelOptions()
        self.rules = tuple(rules)
        self.machine = machine
        self.memory = memory
        self.journal = journal
        # Without a durable journal, one in memory for the agent's life: exactly-once and the
        # in-doubt guard then hold across this process's turns (not across a crash).
        self._journal: ToolJournal = journal if journal is not None else InMemoryJournal()
        self.tracer = tracer or Tracer(None, agent=name)
        self.guards = guards or GuardConfig()
        self.memory_budget_tokens = memory_budget_tokens
        self.masker = masker
        self.tenant_id = tenant_id
        # The one privacy policy: what the tool journal masks with, as the messages are.
        self._redact: Callable[[str], str] | None = None if masker is None else self._mask
        self.name = name
        self.lease_ttl_s = lease_ttl_s
        self.session_wait_s = lease_ttl_s + 5.0 if session_wait_s is None else session_wait_s
        # Bounded: a long-running service sees sessions come and go; an evicted one is rebuilt
        # from the store on its next turn.
        self._owners: _Recent[str, tuple[str, str]] = _Recent(session_cache_size)
        self.engine = ContextEngine(
            model,
            budget=context,
            memory_sink=_MemoryArchive(self) if memory is not None else None,
        )
        self.monitor = SpiralMonitor(prompt_limit=self.engine.budget.limit)
        self._domain_tools = {t.name: t for t in tools}
        clash = set(self._domain_tools) & set(_WORKFLOW_TOOLS)
        if machine is not None and clash:
            raise UsageError(f"tool names {sorted(clash)} are reserved for the workflow")
        self._sessions: _Recent[str, SessionLog] = _Recent(session_cache_size)
        self._owned: list[Callable[[], None]] = []
        self.backends: Backends | None = None
        """The stores :meth:`open` opened (and closes); None for an agent built by hand."""

    # --- construction ---------------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        database: str | Settings | None = None,
        /,
        *,
        system_prompt: str,
        model: ChatModel | str | None = None,
        tools: Sequence[Tool] = (),
        rules: Sequence[str] = (),
        machine: StateMachine | None = None,
        memory: bool = True,
        journal: bool = True,
        redis_url: str | None = None,
        settings: Settings | None = None,
        **options: Any,
    ) -> Agent:
        """An agent whose state, tool journal, traces and memory are opened from one URL.

        ``Agent.open("postgresql://u@host/db", system_prompt=...)``, ``Agent.open(settings,
        ...)`` or ``Agent.open(system_prompt=...)`` (``KEEL_DATABASE``, default: the SQLite
        file in the data directory). ``sqlite:///PATH``: one file holds everything, as
        :meth:`embedded`. ``postgresql://...``: the PostgreSQL stores. A Redis URL
        (``redis_url``, default ``KEEL_REDIS_URL``) moves state and session leases to Redis;
        the journal, traces and memory stay on the SQL database.

        Args:
            database: a database URL, or the settings to read it from (default: the
                ``settings`` argument, else :func:`~keel.settings.load_settings`).
            system_prompt: identity and guardrails.
            model: a ChatModel or a model spec (default: ``settings.model``).
            tools / rules / machine: as for the constructor.
            memory: open long-term memory (embedder: ``settings.embedder``).
            journal: use the durable tool journal. False (a control, not for production):
                the agent keeps one in this process's memory, which a crash loses.
            redis_url: ``redis://...`` for state (default: ``settings.redis_url``; ``""``
                keeps state on the database even when ``KEEL_REDIS_URL`` is set).
            settings: model, embedder, SQLite busy timeout, and the URLs not given.
            options: passed to the constructor (``context=``, ``guards=``, ``masker=``,
                ``tenant_id=``, ``name=``, ...). The masker is also memory's and the tracer's.

        Close the agent with :meth:`aclose` (or ``close``): it stops memory's outbox worker
        (what is left stays in the durable outbox) and releases every connection it opened.

        Raises:
            ConfigError: a URL keel cannot open, or ``settings`` given twice.
            BackendUnavailableError: a server cannot be reached or its driver is missing.
            StoreError: a database cannot be opened or migrated.
        """
        built_here = {"state", "tracer"} & set(options)
        if built_here:
            raise UsageError(
                f"Agent.open builds {sorted(built_here)} from the database URL; to pass your "
                "own stores, construct Agent(...) directly"
            )
        # One privacy policy for messages, the journal, memory and traces; None turns it off.
        privacy = options.get("masker", _DEFAULT_MASKER)
        backends, settings = open_at_edge(
            database, settings, redis_url=redis_url, memory=memory, privacy=privacy
        )
        try:
            chat_model = model if isinstance(model, ChatModel) else resolve_model(model, settings)
            agent = cls.on_backends(
                backends,
                chat_model,
                system_prompt=system_prompt,
                tools=tools,
                rules=rules,
                machine=machine,
                journal=journal,
                **options,
            )
        except BaseException:
            backends.close()
            raise
        agent.backends = backends
        return agent

    @classmethod
    def on_backends(
        cls,
        backends: Backends,
        model: ChatModel,
        *,
        system_prompt: str,
        journal: bool = True,
        **options: Any,
    ) -> Agent:
        """An agent on stores already open (several agents may share them: one per tenant,
        say). The caller keeps the stores: closing the agent does not close them.

        ``options`` are the constructor's (``tools=``, ``tenant_id=``, ``masker=``, ...);
        state, memory, the journal (unless ``journal`` is False) and the tracer come from
        ``backends``, the tracer masking with the agent's privacy policy."""
        # The stores' privacy policy unless the agent has its own: one masker for all of it.
        masker: PIIMasker | None = options.setdefault("masker", backends.privacy)
        tenant_id: str = options.get("tenant_id", "default")
        redact = (
            None if masker is None else functools.partial(masker.mask_text, tenant_id=tenant_id)
        )
        return cls(
            model,
            state=backends.state,
            system_prompt=system_prompt,
            memory=backends.memory,
            journal=backends.journal if journal else None,
            tracer=Tracer(
                backends.traces,
                redact=redact,
                agent=options.get("name", "agent"),
                # A run killed mid-turn reads as abandoned once silent past this limit.
                run_time_limit_s=(options.get("guards") or GuardConfig()).run_timeout_s,
            ),
            **options,
        )

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
        :meth:`open` is the same on any database (and Redis); this one refuses a server URL.

        Raises:
            UsageError: the settings name a server database (use :meth:`open`).
        """
        settings = settings or load_settings()  # an edge: it must know the URL before open
        if settings.sqlite_path is None:
            raise UsageError(
                f"{settings.parsed_database.kind} databases are opened by "
                "Agent.open, not as the embedded SQLite database"
            )
        return cls.open(
            settings.database_url,
            model=model,
            system_prompt=system_prompt,
            tools=tools,
            rules=rules,
            machine=machine,
            memory=memory,
            redis_url="",  # embedded: everything in the one file, whatever KEEL_REDIS_URL says
            settings=settings,
            **options,
        )

    async def aclose(self) -> None:
        """Flush memory's outbox and release what :meth:`open` / :meth:`embedded` opened."""
        if self.backends is not None:
            if self.backends.memory is not None:
                try:
                    # What the last turns wrote is embedded before the worker stops (a process
                    # that ends at once would leave it for the next start-up); bounded, and
                    # what is left stays in the durable outbox.
                    await self.backends.memory.aflush(timeout=_CLOSE_FLUSH_S)
                except (TimeoutError, KeelError) as exc:
                    logger.warning("memory's outbox was not flushed on close: %s", exc)
            await self.backends.aclose()
        while self._owned:
            await asyncio.to_thread(self._owned.pop(0))

    def close(self) -> None:
        """Sync twin of :meth:`aclose`, on the bridge loop the sync twins ran on: async clients
        opened by ``handle_sync`` are closed on their own loop. ``with Agent.open(...) as
        agent:`` (or ``async with``) closes it at the end of the block."""
        run_sync(self.aclose())

    async def __aenter__(self) -> Agent:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __enter__(self) -> Agent:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- public API ---------------------------------------------------------------------------

    @property
    def prompt_limit(self) -> int:
        """Tokens a compiled prompt may take (window, or working budget, minus the reserve)."""
        return self.engine.budget.limit

    def session_key(self, session_id: str) -> str:
        """The key of a session in the state store and the tool journal: scoped to the tenant,
        so the same session id in two tenants never names the same state."""
        return session_key(self.tenant_id, session_id)

    async def handle(self, session_id: str, user_id: str, text: str) -> AgentReply:
        """Process one user message and return the reply (never raises for run failures).

        When a crash left the session's previous turn open, that turn is finished first (its
        journalled tool calls replayed, never repeated) and its reply is attached as
        ``interrupted_turn``; a message identical to the open turn's is taken as the client's
        retry of it and is not handled twice.

        Raises:
            UsageError: ids or message that are not non-empty text.
            AccessDeniedError: the session belongs to another user.
            SessionBusyError: another turn held the session for longer than ``session_wait_s``;
                nothing was changed.
            TurnInterruptedError: another writer took the session over mid-turn; the turn
                stays open and the session's next turn finishes it.
            StoreError: the state store itself is unavailable.
        """
        return await self._handle(session_id, user_id, text, None)

    async def run(
        self,
        text: str,
        *,
        session: str,
        user: str,
        deps: Any = None,
        output_type: type[Any] | None = None,
        model_options: ModelOptions | None = None,
        turn_id: str | None = None,
    ) -> AgentReply:
        """Process one user message of ``user`` in ``session`` and return the reply: the same
        as :meth:`handle`, with the identities named, so they cannot be swapped.

        Args:
            deps: handed to every tool of the turn that declares a :class:`ToolContext`
                parameter, as ``context.deps`` (a database handle, an API client...).
            output_type: this turn's answer type, instead of the agent's.
            model_options: this turn's generation options, instead of the agent's.
            turn_id: the caller's own id for this turn (an HTTP ``Idempotency-Key``): sent
                again, after a timeout or a crash anywhere, the turn runs once. Its reply was
                committed: it is returned (``replayed``). It was left open: it is finished.
                The same id with another message is a ``UsageError``.
        """
        extras = _RunExtras(deps, output_type, model_options, turn_id)
        return await self._handle(session, user, text, None, extras)

    def run_sync(
        self,
        text: str,
        *,
        session: str,
        user: str,
        deps: Any = None,
        output_type: type[Any] | None = None,
        model_options: ModelOptions | None = None,
        turn_id: str | None = None,
    ) -> AgentReply:
        """Sync twin of :meth:`run` (not for use inside a running event loop)."""
        return run_sync(
            self.run(
                text,
                session=session,
                user=user,
                deps=deps,
                output_type=output_type,
                model_options=model_options,
                turn_id=turn_id,
            )
        )

    async def stream(
        self,
        text: str,
        *,
        session: str,
        user: str,
        deps: Any = None,
        output_type: type[Any] | None = None,
        model_options: ModelOptions | None = None,
        turn_id: str | None = None,
    ) -> AsyncIterator[AgentEvent]:
        """Process one user message as :meth:`run` does, yielding its events as they happen:
        masked text deltas, tool calls as they start and end, workflow transitions,
        checkpoints, guard warnings, and last a :class:`TurnFinished` with the reply.

        Every invariant of :meth:`run` holds: a checkpoint precedes each model call, text is
        masked before it is yielded. A consumer that stops early (``break``, ``aclose``, a
        cancelled task) stops the turn where it is: the model request ends, the session stays
        at its last checkpoint with the turn open, and the next message or :meth:`resume`
        finishes it. Raises what :meth:`run` raises, at the point it happens.
        """
        events: asyncio.Queue[AgentEvent | None] = asyncio.Queue()
        extras = _RunExtras(deps, output_type, model_options, turn_id)
        turn = asyncio.create_task(self._handle(session, user, text, events.put_nowait, extras))
        turn.add_done_callback(lambda _: events.put_nowait(None))
        try:
            while (event := await events.get()) is not None:
                yield event
            reply = turn.result()
        finally:
            if not turn.done():
                turn.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await turn
        yield TurnFinished(reply=reply)

    def stream_sync(
        self,
        text: str,
        *,
        session: str,
        user: str,
        deps: Any = None,
        output_type: type[Any] | None = None,
        model_options: ModelOptions | None = None,
        turn_id: str | None = None,
    ) -> Iterator[AgentEvent]:
        """Sync twin of :meth:`stream`: events arrive as they happen; leaving the loop early
        stops the turn as it does there (not for use inside a running event loop)."""
        return iterate_sync(
            self.stream(
                text,
                session=session,
                user=user,
                deps=deps,
                output_type=output_type,
                model_options=model_options,
                turn_id=turn_id,
            )
        )

    async def _handle(
        self,
        session_id: str,
        user_id: str,
        text: str,
        emit: Callable[[AgentEvent], None] | None,
        extras: _RunExtras | None = None,
    ) -> AgentReply:
        _require_id("session_id", session_id)
        _require_id("user_id", user_id)
        text = _user_text(text)
        key = self.session_key(session_id)
        turn_id = extras.turn_id if extras is not None else None
        if turn_id is not None:
            _require_id("turn_id", turn_id)
        async with self._own(key) as lease:
            checkpoint = await self._load(key, user_id)
            interrupted: AgentReply | None = None
            runtime = checkpoint.state.runtime
            if turn_id is not None:
                masked = self._mask(_sanitize(text))
                recorded = next((r for r in runtime.replies if r.get("turn_id") == turn_id), None)
                if recorded is not None:
                    if recorded.get("request") != _request_digest(masked):
                        raise UsageError(f"turn id {turn_id!r} was used for another message")
                    replayed = AgentReply.model_validate(recorded["reply"])
                    return replayed.model_copy(update={"replayed": True})
                if runtime.open_turn == turn_id:
                    if _open_turn_text(checkpoint.state) != masked:
                        raise UsageError(f"turn id {turn_id!r} was used for another message")
                    # The caller's retry of a turn a crash left open: finish it, once.
                    return await self._guarded_turn(
                        lease, key, session_id, user_id, checkpoint, None, emit
                    )
            if runtime.open_turn is not None:
                open_text = _open_turn_text(checkpoint.state)
                interrupted = await self._guarded_turn(
                    lease, key, session_id, user_id, checkpoint, None
                )
                if open_text is not None and open_text == self._mask(_sanitize(text)):
                    return interrupted
                checkpoint = await self.state.aload(key)
            reply = await self._guarded_turn(
                lease, key, session_id, user_id, checkpoint, text, emit, extras
            )
            if interrupted is not None:
                reply = reply.model_copy(update={"interrupted_turn": interrupted})
            return reply

    def handle_sync(self, session_id: str, user_id: str, text: str) -> AgentReply:
        """Sync twin of :meth:`handle` (not for use inside a running event loop). Safe to call
        from several threads at once: turns on one session take turns through its lease."""
        return run_sync(self.handle(session_id, user_id, text))

    async def resume(self, session_id: str, user_id: str) -> AgentReply | None:
        """Finish a turn that a crash interrupted; None when the session has no open turn.

        Raises:
            AccessDeniedError: the session belongs to another user.
            SessionBusyError: another turn holds the session.
        """
        _require_id("session_id", session_id)
        _require_id("user_id", user_id)
        key = self.session_key(session_id)
        async with self._own(key) as lease:
            checkpoint = await self.state.aget(key)
            if checkpoint is None:
                return None
            self._check_owner(checkpoint.state, user_id)
            if checkpoint.state.runtime.open_turn is None:
                return None
            return await self._guarded_turn(lease, key, session_id, user_id, checkpoint, None)

    def resume_sync(self, session_id: str, user_id: str) -> AgentReply | None:
        """Sync twin of :meth:`resume`."""
        return run_sync(self.resume(session_id, user_id))

    def session_state(self, session_id: str) -> AgentState | None:
        """The session's committed state (in this agent's tenant), or None; a state another
        tenant's agent wrote (under a key that should never be this session's) is None too."""
        checkpoint = self.state.get(self.session_key(session_id))
        if checkpoint is None or not self.owns(checkpoint.state):
            return None
        return checkpoint.state

    def owns(self, state: AgentState) -> bool:
        """Whether ``state`` is of this agent's tenant (a state that names no tenant is)."""
        return state.runtime.tenant_id in (None, self.tenant_id)

    # --- owning a session ---------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _own(self, key: str) -> AsyncIterator[_Lease]:
        lock = self.state.session_lock(key, ttl=self.lease_ttl_s)
        if not await lock.aacquire(self.session_wait_s):
            raise SessionBusyError(key, self.session_wait_s)
        lease = _Lease(lock, key)
        heartbeat = asyncio.create_task(lease.heartbeat())
        try:
            yield lease
        finally:
            await lease.end(heartbeat)
            if not lease.lost:
                try:
                    await lock.arelease()
                except StoreError:
                    # It expires by itself; the next turn waits at most its time to live.
                    logger.warning("could not release the lease on session %s", key)

    def _check_owner(self, state: AgentState, user_id: str) -> None:
        runtime = state.runtime
        if (runtime.user_id is not None and runtime.user_id != user_id) or (
            runtime.tenant_id is not None and runtime.tenant_id != self.tenant_id
        ):
            raise AccessDeniedError("this session belongs to another user")

    async def _load(self, key: str, user_id: str) -> Checkpoint[AgentState]:
        # Read, never changed: the turn builds its state with model_copy and its own log.
        checkpoint = await self.state.apeek(key)
        if checkpoint is None:
            initial = AgentState(
                max_steps=_UNBOUNDED_STEPS,
                machine=self.machine.start() if self.machine is not None else None,
                runtime=SessionRuntime(tenant_id=self.tenant_id, user_id=user_id),
            )
            checkpoint = await self.state.acreate(key, initial, good=True)
        self._check_owner(checkpoint.state, user_id)
        return checkpoint

    # --- one turn -----------------------------------------------------------------------------

    async def _guarded_turn(
        self,
        lease: _Lease,
        key: str,
        session_id: str,
        user_id: str,
        checkpoint: Checkpoint[AgentState],
        text: str | None,
        emit: Callable[[AgentEvent], None] | None = None,
        extras: _RunExtras | None = None,
    ) -> AgentReply:
        try:
            return await self._turn(lease, key, session_id, user_id, checkpoint, text, emit, extras)
        except BaseException:
            # Whatever stopped the turn, the session's log may hold messages that were never
            # committed: the next turn builds it again from the store.
            self._sessions.pop(key, None)
            raise

    def _log(self, key: str, state: AgentState, version: int) -> SessionLog:
        """The session's log at ``version``: the cached one, or built from ``state``."""
        cached = self._sessions.get(key)
        if cached is not None and cached.version == version:
            self._sessions.move_to_end(key)
            return cached
        log = SessionLog.of(self.engine, key, state, version)
        self._sessions[key] = log
        return log

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

    async def _turn(
        self,
        lease: _Lease,
        key: str,
        session_id: str,
        user_id: str,
        checkpoint: Checkpoint[AgentState],
        text: str | None,
        emit: Callable[[AgentEvent], None] | None = None,
        extras: _RunExtras | None = None,
    ) -> AgentReply:
        started = time.monotonic()
        extras = extras or _RunExtras()
        self._owners[key] = (session_id, user_id)
        state, version = checkpoint.state, checkpoint.version
        resume = text is None
        position = state.machine
        runtime = state.runtime
        log = self._log(key, state, version)
        if resume:
            turn_id = runtime.open_turn or uuid.uuid4().hex
            start = runtime.open_turn_message
            messages = state.messages
            if start is None or start >= len(messages):
                start = max(
                    (i for i, m in enumerate(messages) if _is_user_turn(m)), default=len(messages)
                )
            user_message = messages[start] if start < len(messages) else Message.user("")
        else:
            assert text is not None
            if (
                position is not None
                and self.machine is not None
                and self.machine.is_terminal(position)
            ):
                # A finished workflow instance: the next message starts a new one.
                finished = (*runtime.finished_workflows, position.model_dump(mode="json"))
                runtime = runtime.model_copy(
                    update={"finished_workflows": finished[-_FINISHED_KEPT:]}
                )
                position = self.machine.start()
            turn_id = extras.turn_id or uuid.uuid4().hex
            turn_number = runtime.turns + 1
            metadata: dict[str, Any] = {"turn": turn_number, "turn_id": turn_id}
            if extras.turn_id is not None:
                metadata["client_turn"] = True
            user_message = Message.user(self._mask(_sanitize(text)), metadata=metadata)
            log.append(user_message)
            start = len(log) - 1
            runtime = runtime.model_copy(
                update={
                    "turns": turn_number,
                    "open_turn": turn_id,
                    "open_turn_message": start,
                    "tenant_id": self.tenant_id,
                    "user_id": user_id,
                }
            )
        # Until the turn's first checkpoint, the store holds the log up to the new message.
        written = len(log) if resume else len(log) - 1
        messages = log.live
        state = state.model_copy(
            update={"messages": messages, "machine": position, "runtime": runtime}
        )

        run = await self.tracer.astart_run(
            session_id,
            user_id=user_id,
            tenant_id=self.tenant_id,
            agent=self.name,
            input=user_message.content,
            attributes={"resumed": resume, "turn_id": turn_id},
            time_limit_s=self.guards.run_timeout_s,
            buffered=True,
        )
        if resume:
            await self.tracer.atake_over_turn(run, turn_id)
        turn = _Turn(
            key=key,
            session_id=session_id,
            user_id=user_id,
            turn_id=turn_id,
            user_message=user_message,
            turn_start=start,
            state=state,
            version=version,
            log=log,
            written=written,
            memories=[],
            position=position,
            run=run,
            deadline=started + self.guards.run_timeout_s,
            lease=lease,
            position_checkpointed=position,
            emit=emit,
            deps=extras.deps,
            output_type=extras.output_type or self.output_type,
            model_options=extras.model_options or self.model_options,
            record_reply=bool(user_message.metadata.get("client_turn")),
        )
        try:
            turn.memories = await self._memories(user_id, user_message.content)
            turn.registry = self._registry(turn)
            turn.loop_start = len(log)
            result = await self._loop(turn).arun(
                messages, session_id=key, first_step=state.step, turn_id=turn_id
            )
        except asyncio.CancelledError:
            # Ctrl-C, or a caller that stopped reading the stream: the turn stays open at its
            # last checkpoint for the next message to finish, and its run says so.
            await run.aend(error=TurnInterruptedError(session_id, "cancelled by the caller"))
            raise
        except ConflictError as exc:
            await run.aend("failed", error=exc)
            if isinstance(exc, TurnInterruptedError) or not turn.committed:
                raise
            raise TurnInterruptedError(key, "another writer committed first") from exc
        except StoreError as exc:
            # The store itself failed: the turn stays open at its last checkpoint.
            await run.aend("failed", error=exc)
            raise
        except KeelError as exc:
            return await self._fail(turn, exc)
        except Exception as exc:
            # A bug in user code the loop does not own (a hook, a tool gate): the turn ends
            # cleanly at the last good state instead of leaving it open for ever.
            logger.exception("turn on session %s failed unexpectedly", key)
            return await self._fail(turn, KeelError(f"{type(exc).__name__}: {exc}"), cause=exc)
        return await self._commit(turn, result, resume=resume)

    def _loop(self, turn: _Turn) -> ToolLoop:
        # The run's time limit covers the whole turn: what memory retrieval took is gone, and
        # a slice is kept back for the commit.
        remaining = turn.remaining()
        margin = min(2.0, self.guards.run_timeout_s * 0.1)
        guards = self.guards.model_copy(update={"run_timeout_s": max(remaining - margin, 0.001)})
        assert turn.registry is not None
        return ToolLoop(
            self.model,
            turn.registry,
            guards=guards,
            journal=self._journal,
            hooks=LoopHooks(
                before_model_call=lambda step, history: self._before_model_call(
                    turn, step, history
                ),
                after_step=lambda record: self._after_step(turn, record),
                state_fingerprint=lambda: self._fingerprint(turn),
                revert_to_last_good=lambda error: self._on_guard_stop(turn, error),
                before_side_effect=lambda call: turn.lease.check(),
                refuse_call=lambda call: self._refusal(turn, call),
                model_options=lambda step, options: options.model_copy(
                    update={"max_tokens": self._answer_limit(turn)}
                ),
                **self._stream_hooks(turn),
            ),
            monitor=self.monitor,
            agent=self.name,
            redact=self._redact,
            output_schema=turn.output_type,
            options=self._model_options(turn),
            tool_scope=ToolScope(
                user_id=turn.user_id,
                tenant_id=self.tenant_id,
                run_id=turn.run.run_id,
                deps=turn.deps,
            ),
        )

    def _model_options(self, turn: _Turn) -> ModelOptions:
        options = turn.model_options
        if turn.output_type is None or options.json_schema is not None:
            return options
        # Providers that can enforce a schema do (structured outputs, a grammar).
        return options.model_copy(update={"json_schema": output_json_schema(turn.output_type)})

    def _answer_limit(self, turn: _Turn) -> int:
        """What the next model call may generate (DESIGN.md, "The answer's limit"): the room its
        compiled prompt left in the window, at most the model's output limit, never less than
        the reserve (room no prompt takes); the caller's ``max_tokens``, when given, caps it."""
        budget = self.engine.budget
        prompt = turn.last_prompt
        used = (prompt.tokens if prompt is not None else budget.limit) + turn.last_headroom
        room = min(budget.effective_window - used, self.model.profile.max_output_tokens)
        room = max(room, budget.reserve, 1)
        asked = turn.model_options.max_tokens
        return room if asked is None else min(asked, room)

    def _headroom(self, turn: _Turn) -> int:
        """Tokens to leave free beyond the answer reserve in the next prompt: none, unless the
        provider just said the prompt was too long. Our count and theirs then disagree (a
        template or tokenizer we could only estimate): the retry gets a third less room."""
        if not turn.shrink_next:
            return 0
        limit = self.engine.budget.limit
        return limit - max(1024, int(limit * 2 / 3))

    def _rules(self, turn: _Turn) -> list[str]:
        rules = list(self.rules)
        if turn.output_type is not None:
            schema = json.dumps(output_json_schema(turn.output_type), ensure_ascii=False)
            rules.append(
                "When you give your final answer, reply with only one JSON object that follows "
                f"this JSON schema: {schema}"
            )
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

    async def _write(self, turn: _Turn, state: AgentState, **options: Any) -> int:
        """A compare-and-set checkpoint of the turn on the version it last wrote or read."""
        version = await self.state.acheckpoint(
            turn.key, state, expected_version=turn.version, **options
        )
        turn.version = version
        turn.state = state
        turn.written = len(state.messages)
        turn.committed = True
        # The log holds exactly the messages just written: it stays valid for the new version.
        turn.log.version = version
        if turn.emit is not None:
            turn.emit(CheckpointCommitted(version=version, reason=options["reason"]))
        return version

    async def _append(self, turn: _Turn, update: dict[str, Any], **options: Any) -> int:
        """A compare-and-set checkpoint of the turn that appends the log's messages since the
        last one and sets ``update``'s fields: its cost is what is new, however long the
        session's history is."""
        new = turn.log.since(turn.written)
        version = await self.state.aappend(
            turn.key,
            {"messages": new} if new else {},
            update=update,
            expected_version=turn.version,
            **options,
        )
        turn.version = version
        turn.state = turn.state.model_copy(update={**update, "messages": turn.log.live})
        turn.written += len(new)
        turn.committed = True
        turn.log.version = version
        if turn.emit is not None:
            turn.emit(CheckpointCommitted(version=version, reason=options["reason"]))
        return version

    async def _before_model_call(
        self, turn: _Turn, step: int, history: Sequence[Message]
    ) -> list[Message]:
        turn.log.take(history, self._mask_message)
        # The checkpoint before the model call: compare-and-set on the version we read.
        await self._append(
            turn,
            {"step": step, "machine": turn.position, "runtime": turn.state.runtime},
            reason="before model call",
            step=step,
        )
        # The trace so far is made durable with the checkpoint: a process killed during the
        # model call leaves both at the same point.
        await turn.run.aflush()
        assert turn.registry is not None
        turn.last_headroom = self._headroom(turn)
        prompt = self.engine.compile(
            turn.log.conversation,
            system=self.system_prompt,
            rules=self._rules(turn),
            memories=turn.memories,
            tools=turn.registry.schemas(),
            extra_headroom=turn.last_headroom,
        )
        turn.shrink_next = False
        turn.last_prompt = prompt
        turn.max_prompt_tokens = max(turn.max_prompt_tokens, prompt.tokens)
        return list(prompt.messages)

    async def _after_step(self, turn: _Turn, record: StepRecord) -> None:
        if record.error_type == "ContextLengthExceededError":
            turn.shrink_next = True
        if turn.emit is not None:
            self._end_streamed_step(turn, record)
        await arecord_loop_step(
            turn.run,
            record,
            model=self.model.spec,
            budget=turn.last_prompt.report if turn.last_prompt else None,
            state_version=turn.version,
            transitions=turn.transitions,
        )
        turn.transitions.clear()
        calls = {call.id: call for call in (record.response.tool_calls if record.response else ())}
        for result in record.tool_results:
            if result.ok and result.tool not in _WORKFLOW_TOOLS:
                turn.tool_calls.append(
                    ToolCall(id=result.call_id, name=result.tool, arguments=result.raw_arguments)
                )
            if self._is_effect(result):
                call = calls.get(result.call_id) or ToolCall(
                    id=result.call_id, name=result.tool, arguments=result.raw_arguments
                )
                turn.effects.append(
                    (self._mask_call(call), self._mask_message(result.to_message()))
                )
        if turn.position != turn.position_checkpointed:
            # A checkpoint after every transition (and slot gathered).
            await self._append(
                turn, {"machine": turn.position}, reason="after transition", step=record.step
            )
            turn.position_checkpointed = turn.position

    # --- streaming ----------------------------------------------------------------------------

    def _stream_hooks(self, turn: _Turn) -> dict[str, Any]:
        """The loop hooks that turn a streamed turn's model text and tool calls into events."""
        emit = turn.emit
        if emit is None:
            return {}

        def on_text(step: int, text: str) -> None:
            if self.masker is None:
                # Masking is off: nothing to hold back.
                turn.streamed_text[step] = None
                turn.shown_steps.add(step)
                emit(TextDelta(step=step, text=_sanitize(text)))
                return
            masker = turn.streamed_text.get(step)
            if masker is None:
                policy = self.masker
                tenant_id = self.tenant_id
                masker = turn.streamed_text[step] = StreamMasker(
                    # Each call masks a longer prefix, never seen again: not worth caching.
                    lambda whole: policy.mask_text(
                        _sanitize(whole), tenant_id=tenant_id, remember=False
                    ),
                    by_word=policy.streams_by_word(tenant_id),
                )
            released = masker.feed(text)
            if released:
                turn.shown_steps.add(step)
                emit(TextDelta(step=step, text=released))

        def on_tool_start(step: int, call: ToolCall, arguments: dict[str, Any]) -> None:
            masked = arguments if self._redact is None else redact_json(arguments, self._redact)
            emit(ToolCallStarted(step=step, call_id=call.id, name=call.name, arguments=masked))

        def on_tool_result(step: int, result: ToolResult) -> None:
            emit(
                ToolCallFinished(
                    step=step,
                    call_id=result.call_id,
                    name=result.tool,
                    status=result.status,
                    ok=result.ok,
                    result=self._mask_message(result.to_message()).content,
                )
            )

        return {
            "on_text": on_text,
            "on_tool_start": on_tool_start,
            "on_tool_result": on_tool_result,
        }

    def _end_streamed_step(self, turn: _Turn, record: StepRecord) -> None:
        """A step ended: the rest of its streamed text, or its withdrawal; its guard events."""
        emit = turn.emit
        assert emit is not None
        streamed = record.step in turn.streamed_text
        masker = turn.streamed_text.pop(record.step, None)
        shown = record.step in turn.shown_steps
        if record.action == "continued":
            # The answer goes on in the next step: one masker over all its parts, so a value
            # the cut split in two is still masked whole.
            if streamed:
                turn.streamed_text[record.step + 1] = masker
                turn.continued_steps.append(record.step)
        elif record.answer_parts:
            # A failed call while an answer is continued: its parts stand, the next step goes
            # on. This step's own text is withdrawn (and its masker with it: the reply is
            # authoritative for a tail that masker held back).
            if shown:
                emit(TextDiscarded(step=record.step, reason=self._mask(record.error or "")))
            elif streamed:
                turn.streamed_text[record.step + 1] = masker
        elif record.action in ("final", "tool_calls"):
            rest = masker.finish() if masker is not None else ""
            if rest:
                emit(TextDelta(step=record.step, text=rest))
            turn.continued_steps.clear()
        else:
            reason = self._mask(record.error or "the reply could not be used")
            # An answer being continued that ends unusable takes its earlier parts with it.
            withdrawn = [*turn.continued_steps, record.step] if shown else turn.continued_steps
            for step in withdrawn:
                emit(TextDiscarded(step=step, reason=reason))
            turn.continued_steps.clear()
        for event in record.guard_events:
            emit(GuardWarning(step=record.step, message=self._mask(event)))

    def _release_held_text(self, turn: _Turn) -> None:
        """The answer ended cut while it was being continued: what a masker still holds back
        of it is part of the answer, streamed now."""
        assert turn.emit is not None
        for step, masker in turn.streamed_text.items():
            rest = masker.finish() if masker is not None else ""
            if rest:
                turn.emit(TextDelta(step=step, text=rest))

    def _is_effect(self, result: ToolResult) -> bool:
        """A side-effecting call that ran (now or before a crash) or may have run."""
        declared = self._domain_tools.get(result.tool)
        if declared is None or not declared.side_effect:
            return False
        return (
            result.ok
            or result.status in ("in_doubt", "timeout")
            or (result.status == "failed" and result.executed)
        )

    def _mask(self, text: str) -> str:
        if self.masker is None or not text:
            return text
        return self.masker.mask_text(text, tenant_id=self.tenant_id)

    def _mask_call(self, call: ToolCall) -> ToolCall:
        arguments = self._mask(_sanitize(call.arguments))
        return (
            call
            if arguments == call.arguments
            else call.model_copy(update={"arguments": arguments})
        )

    def _mask_message(self, message: Message) -> Message:
        content = self._mask(_sanitize(message.content))
        calls = tuple(self._mask_call(call) for call in message.tool_calls)
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

    def _effect_messages(self, turn: _Turn) -> list[Message]:
        """The side effects of the turn as an assistant call message and its results."""
        if not turn.effects:
            return []
        calls = tuple(call for call, _ in turn.effects)
        return [Message.assistant("", tool_calls=calls), *(result for _, result in turn.effects)]

    def _effects_note(self, turn: _Turn) -> str:
        done = "; ".join(
            f"{call.name}: {_clip(result.content, 160)}" for call, result in turn.effects
        )
        return f"\n\nWhat was done before I stopped: {done}"

    async def _failure_base(self, turn: _Turn) -> AgentState:
        # Back to the last good checkpoint, keeping the exchange and the failure count.
        last_good = await self.state.alast_good(turn.key)
        if last_good is None:
            written = list(turn.state.messages[: turn.written])
            return turn.state.model_copy(update={"messages": written})
        return (await self.state.aat(turn.key, last_good.version)).state

    async def _commit(self, turn: _Turn, result: LoopResult, *, resume: bool) -> AgentReply:
        if turn.emit is not None and result.truncated:
            self._release_held_text(turn)
        turn.log.take_added(result.new_messages, turn.loop_start, self._mask_message)
        position = turn.position
        reverted = False
        status = result.status
        text = self._mask(_sanitize(result.text))
        runtime = turn.state.runtime.model_copy(
            update={"open_turn": None, "open_turn_message": None}
        )
        if result.ok:
            segment = turn.log.since(turn.turn_start)
            kept = _without_corrections(segment)
            rebuilt = len(kept) != len(segment)
            update: dict[str, Any] = {
                "step": max(result.next_step, turn.state.step),
                "machine": position,
                "runtime": runtime,
            }
            if rebuilt:
                before = turn.log.messages[: turn.turn_start]
                update["messages"] = [*before, *kept]
            final_state = turn.state.model_copy(update=update)
        else:
            reverted = True
            base = await self._failure_base(turn)
            position = base.machine
            if self.machine is not None and position is not None:
                before_state = position.state
                position = self.machine.record_failure(position, status)
                if position.state != before_state:
                    await turn.run.arecord(
                        "reset", "reset", error_message=position.failure_reason or status
                    )
            if turn.effects:
                text += self._effects_note(turn)
            kept_messages = [
                *base.messages,
                turn.user_message,
                *self._effect_messages(turn),
                _unanswered_note(status),
            ]
            final_state = base.model_copy(
                update={
                    "messages": kept_messages,
                    "step": max(result.next_step, turn.state.step),
                    "machine": position,
                    "runtime": runtime.model_copy(
                        update={
                            "summary": base.runtime.summary,
                            "messages_summarized": base.runtime.messages_summarized,
                            "turns_summarized": base.runtime.turns_summarized,
                        }
                    ),
                }
            )
            rebuilt = True
        error = self._mask(result.error_message) if result.error_message else None
        reply = AgentReply(
            text=text,
            status=status,
            session_id=turn.session_id,
            run_id=turn.run.run_id,
            state_version=turn.version + 1,
            workflow_state=position.state if position is not None else None,
            steps=len(result.steps),
            max_prompt_tokens=turn.max_prompt_tokens,
            prompt_limit=self.prompt_limit,
            loops_detected=result.loops_detected,
            tool_calls=tuple(r.tool for step in result.steps for r in step.tool_results),
            effects=tuple(call.name for call, _ in turn.effects),
            reverted=reverted or result.reverted,
            truncated=result.truncated,
            resumed=resume,
            output=result.output if result.ok else None,
            error=error,
        )
        final_state = self._with_reply(turn, final_state, reply)
        reason = "turn completed" if result.ok else f"turn failed: {status}"
        if rebuilt:
            version = await self._write(turn, final_state, reason=reason, good=True)
            # History was rewritten: the log is built again from the store next turn.
            self._sessions.pop(turn.key, None)
        else:
            # The turn's messages stand as they are: appended, whatever the history's length.
            version = await self._append(
                turn,
                {name: getattr(final_state, name) for name in ("step", "machine", "runtime")},
                reason=reason,
                good=True,
            )
            final_state = turn.state
        if result.ok:
            version = await self._summarize(turn, final_state, version)
            if self.memory is not None:
                self._remember_turn(turn, text)
                if (
                    self.machine is not None
                    and position is not None
                    and self.machine.is_terminal(position)
                    and position.state != self.machine.failure
                ):
                    self._remember_run(turn)
        await turn.run.aend(
            "succeeded" if result.ok else _run_status(status), output=text, error=result.error
        )
        return reply.model_copy(update={"state_version": version})

    async def _fail(
        self, turn: _Turn, error: KeelError, *, cause: BaseException | None = None
    ) -> AgentReply:
        """A failure outside the loop's own handling: back to the last good state, keeping the
        user's message and any side effect that happened. The run ends with what the user is
        told (``cause``: the error as raised, when ``error`` wraps it)."""
        text = _FAILURE_REPLY
        if turn.effects:
            text = (
                "I'm sorry, something went wrong on my side before I could finish."
                + self._effects_note(turn)
            )
        await turn.run.aend(error=cause or error, output=text)
        base = await self._failure_base(turn)
        final_state = base.model_copy(
            update={
                "messages": [
                    *base.messages,
                    turn.user_message,
                    *self._effect_messages(turn),
                    _unanswered_note("failed"),
                ],
                "step": max(turn.state.step, base.step),
                "runtime": base.runtime.model_copy(
                    update={
                        "turns": turn.state.runtime.turns,
                        "open_turn": None,
                        "open_turn_message": None,
                        "tenant_id": self.tenant_id,
                        "user_id": turn.user_id,
                    }
                ),
            }
        )
        reply = AgentReply(
            text=text,
            status="failed",
            session_id=turn.session_id,
            run_id=turn.run.run_id,
            state_version=turn.version + 1,
            workflow_state=base.machine.state if base.machine is not None else None,
            effects=tuple(call.name for call, _ in turn.effects),
            reverted=True,
            error=self._mask(f"{type(error).__name__}: {error}"),
        )
        final_state = self._with_reply(turn, final_state, reply)
        version = await self._write(turn, final_state, reason="turn failed: failed", good=True)
        self._sessions.pop(turn.key, None)
        return reply.model_copy(update={"state_version": version})

    def _with_reply(self, turn: _Turn, state: AgentState, reply: AgentReply) -> AgentState:
        """``state`` with the turn's reply recorded, when the caller gave the turn its id: the
        reply is committed in the same write as the turn, so a retry finds exactly that."""
        if not turn.record_reply:
            return state
        runtime = state.runtime
        record = {
            "turn_id": turn.turn_id,
            "request": _request_digest(turn.user_message.content),
            "reply": reply.model_dump(mode="json"),
        }
        kept = [r for r in runtime.replies if r.get("turn_id") != turn.turn_id]
        replies = (*kept, record)[-_REPLIES_KEPT:]
        return state.model_copy(update={"runtime": runtime.model_copy(update={"replies": replies})})

    async def _summarize(self, turn: _Turn, committed: AgentState, version: int) -> int:
        """Fold old turns into the running summary after the commit, within the time left;
        a summary that cannot be finished or saved is simply tried again next turn."""
        log = self._log(turn.key, committed, version)
        appending = log is turn.log
        conversation = log.conversation
        remaining = turn.remaining()
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
                version = await self._append(
                    turn, {"runtime": runtime}, reason="summary", good=True
                )
            else:
                version = await self._write(
                    turn,
                    committed.model_copy(update={"runtime": runtime}),
                    reason="summary",
                    good=True,
                )
        except (ConflictError, StoreError):
            # The turn is committed; only its summary is not. The conversation already folded
            # the turns, so it is rebuilt from the store next time.
            self._sessions.pop(turn.key, None)
            logger.warning("the summary of session %s could not be saved", turn.key)
            return version
        log.version = version
        return version

    def _remember_turn(self, turn: _Turn, reply: str) -> None:
        """The turn's words in memory, each with its speaker's provenance: what the user wrote
        is the user's claim; what the model answered is the assistant's, never the user's (a
        model inventing "you live at 1027 Bergen Street" is not the user saying so)."""
        from keel.memory import Scope

        assert self.memory is not None
        scope = Scope(tenant_id=self.tenant_id, user_id=turn.user_id)
        said: tuple[tuple[str, str, Provenance], ...] = (
            ("user", f"User: {turn.user_message.content}", "user_claim"),
            ("assistant", f"Assistant: {reply}", "inferred"),
        )
        for speaker, text, provenance in said:
            self.memory.add(
                text,
                scope=scope,
                kind="episodic",
                type="turn",
                provenance=provenance,
                session_id=turn.session_id,
                turn=turn.state.runtime.turns,
                metadata={"speaker": speaker},
            )

    def _remember_run(self, turn: _Turn) -> None:
        if self.memory is None or not turn.tool_calls:
            return
        from keel.memory import Scope

        task = next((m.content for m in turn.state.messages if _is_user_turn(m)), "")
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
            registry.register(domain_tool)
        if self.machine is not None:
            for workflow_tool in self._workflow_tools(turn):
                registry.register(workflow_tool)
        return registry

    def _refusal(self, turn: _Turn, call: ToolCall) -> str | None:
        """Why the workflow's current step does not allow ``call`` (None: it does). Asked
        before the call is journalled, so a refused side effect leaves no trace of an intent."""
        machine, position = self.machine, turn.position
        if machine is None or position is None or call.name not in self._domain_tools:
            return None
        allowed = machine.tools(position)
        if call.name in allowed:
            return None
        return (
            f"{call.name} is not allowed in step {position.state!r} "
            f"(allowed: {', '.join(allowed) or 'none'}); move the workflow on with go_to first"
        )

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
            if turn.emit is not None and moved.state != position.state:
                turn.emit(WorkflowTransition(source=position.state, target=moved.state))
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


SUMMARY_KEY_PREFIX = "keel:summary:"
"""A session's running summary is kept in memory under this prefix and the session id."""


class _MemoryArchive:
    """The context engine's :class:`~keel.context.MemorySink`: committed summaries go to
    long-term memory (the evicted turns are there already: every turn is remembered as it ends).

    Memory keeps one summary per session, the latest: each running summary restates most of the
    one before (which the prompt held), so storing every one filled memory with copies (158 of
    166 summaries over a 507-turn ``keel demo``). What a summary drops is in the turns.
    """

    def __init__(self, agent: Agent) -> None:
        self._agent = agent

    async def archive(self, session_id: str, evicted: Sequence[Message], summary: str) -> None:
        memory = self._agent.memory
        owner = self._agent._owners.get(session_id)
        if memory is None or owner is None or not summary.strip():
            return
        from keel.memory import Scope

        plain_session, user_id = owner
        # Under the session's key the new summary replaces the last one in the same
        # transaction, so a retried summary is safe and only the newest is kept.
        await asyncio.to_thread(
            memory.add,
            summary,
            scope=Scope(tenant_id=self._agent.tenant_id, user_id=user_id),
            kind="episodic",
            type="summary",
            provenance="inferred",
            session_id=plain_session,
            key=f"{SUMMARY_KEY_PREFIX}{plain_session}",
        )


def _run_status(status: str) -> Any:
    if status in ("step_limit", "time_limit"):
        return "limited"
    if status in ("loop_detected", "tool_in_doubt"):
        return "escalated"
    return "failed"


def session_key(tenant_id: str, session_id: str) -> str:
    """The store key of ``session_id`` in ``tenant_id``: ``tenant/session``, the tenant
    percent-encoded so that no tenant and session pair can spell another's key."""
    _require_id("tenant_id", tenant_id)
    _require_id("session_id", session_id)
    return f"{quote(tenant_id, safe='')}/{session_id}"


def _require_id(name: str, value: object) -> None:
    if not isinstance(value, str):
        raise UsageError(f"{name} must be a string, got {type(value).__name__}")
    if not value.strip() or _LONE_SURROGATE.search(value) or not value.isprintable():
        raise UsageError(f"{name} must be non-empty printable text, got {value!r}")


def _user_text(text: object) -> str:
    if not isinstance(text, str):
        raise UsageError(f"the user message must be a string, got {type(text).__name__}")
    visible = "".join(
        ch for ch in text if not ch.isspace() and unicodedata.category(ch) not in ("Cf", "Cc")
    )
    if not visible:
        raise UsageError("the user message is empty")
    if "\x00" in text:
        # PostgreSQL cannot store a NUL; SQLite could, so both refuse it before a turn starts.
        raise UsageError("the user message holds a NUL character (U+0000)")
    return text


def _sanitize(text: str) -> str:
    """Text that can be stored: lone surrogates (legal in JSON, not in UTF-8) become U+FFFD."""
    if not text:
        return text
    return _LONE_SURROGATE.sub("\ufffd", text)


def _is_user_turn(message: Message) -> bool:
    """A message the user wrote (runtime corrections travel as user messages too)."""
    return message.role == "user" and "keel_correction" not in message.metadata


def _unanswered_note(status: str) -> Message:
    """What the history keeps of a turn keel ended without an answer: a note in keel's name.
    The user got keel's apology (the reply, the trace); the model is never shown it as its own
    answer, only that the turn got none."""
    return runtime_note(
        f"The turn above ended without an answer from the assistant ({status}); "
        "keel told the user so.",
        reason=status,
    )


def _open_turn_text(state: AgentState) -> str | None:
    index = state.runtime.open_turn_message
    if index is None or index >= len(state.messages):
        return None
    return state.messages[index].content


def _without_corrections(segment: list[Message]) -> list[Message]:
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


def _clip(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _request_digest(masked_text: str) -> str:
    """What identifies a turn's request for its retries: its (masked) message."""
    return hashlib.sha256(masked_text.encode()).hexdigest()
