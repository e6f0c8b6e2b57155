"""The agent: one turn of DESIGN.md's flow, joining state, memory, context, models and tools.

``await agent.handle(session_id, user_id, text)``:

1. own the session: take its lease in the state store (across threads, event loops and
   processes), renewed while the turn runs; every write is still compare-and-set (fencing);
2. load the session's typed state, keyed by (tenant, session) and owned by one user; a turn
   that a crash left open is finished first;
3. retrieve long-term memories within their token budget;
4. compile the context (exact budgets, window + summary, pruning; budget report kept);
5. checkpoint BEFORE every model call (compare-and-set on the version read);
6. run the model and tool steps (the turn's `TurnRunner` drives
   them, as [`ToolLoop`][] does standalone): validation, repair,
   exactly-once journal (keys unique to the turn), loop detection, step and time limits;
7. apply workflow transitions from the model's structured tool calls (``go_to`` /
   ``remember``), never from regexes on prose, checkpointing after each one;
8. commit the turn (marked good), then fold old turns into the running summary, hand the turn
   to memory through the outbox, and write the trace; all within the run's time limit.

Any failure leaves the session at its last good checkpoint with a clean message for the user,
except that side effects that happened stay in the history (reverting never hides a booking).
Failures are counted per workflow state and a persistent one moves the machine to its failure
state. A turn interrupted by a crash is finished by [`Agent.resume`][], or by the next
``handle`` on the session before it handles the new message, replaying the journalled tool
calls of the interrupted step instead of running them again.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Unpack

from keel._bridge import iterate_sync, run_sync
from keel.context import ContextBudget, ContextEngine
from keel.errors import UsageError
from keel.guards import GuardConfig, SpiralMonitor
from keel.models import ChatModel, ModelOptions
from keel.privacy import DEFAULT_MASKER, NoVault, PIIMasker, Vault
from keel.runtime._approvals import Approvals
from keel.runtime._commit import SUMMARY_KEY_PREFIX, hand_off
from keel.runtime._events import AgentEvent, events_of
from keel.runtime._log import SessionLogs
from keel.runtime._masking import Masking, ModelSees, checked_model_sees
from keel.runtime._open import (
    EmbeddedOptions,
    OnBackendsOptions,
    OpenOptions,
    agent_on_backends,
    close_opened,
    embedded_agent,
    open_agent,
)
from keel.runtime._reply import AgentReply
from keel.runtime._session import DecideOptions, Sessions, require_id, session_key
from keel.runtime._turn import RunExtras, TurnDeps, TurnOptions
from keel.runtime._workflow import Workflow
from keel.settings import Settings
from keel.state import AgentState, Checkpoint, StateMachine, StateStore
from keel.stores import Backends
from keel.tools import InMemoryJournal, MCPServer, Tool, ToolJournal
from keel.tracing import Tracer

if TYPE_CHECKING:
    from keel.memory import Memory

__all__ = ["SUMMARY_KEY_PREFIX", "Agent", "AgentReply", "session_key"]

logger = logging.getLogger("keel.runtime")


class Agent:
    """A resilient agent: typed state, memory, bounded context, validated tools, traces.

    Args:
        model: the chat model.
        state: the state store (``StateStore(backend, AgentState)``); every write is
            compare-and-set on the version read.
        system_prompt: identity and guardrails; always message 0 of every prompt.
        tools: the domain tools, and MCP servers ([`MCPServer`][]) whose tools join.
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
        vault / model_sees: the PII vault (tools and replies get values), what the model sees.
        tenant_id: the tenant every session, journal entry, trace and memory is scoped to.
        name: the agent's name in traces and death-spiral indicators.
        lease_ttl_s: how long a turn's lease on its session lasts without renewal (it is
            renewed every third of that while the turn runs). A lease whose holder died on
            this machine is taken over at once; one held elsewhere frees when it expires.
        session_wait_s: how long a turn waits for a session another turn holds before it
            gives up with [`SessionBusyError`][keel.errors.SessionBusyError] (default: the lease's
            time to live and 5 s, so a crashed holder's lease can expire).
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
        approvals: where calls that wait for a person (``@tool(approval=...)``) wait, who is
            told, how long (see [`decide`][]).
    """

    def __init__(
        self,
        model: ChatModel,
        *,
        state: StateStore[AgentState],
        system_prompt: str,
        tools: Sequence[Tool | MCPServer] = (),
        rules: Sequence[str] = (),
        machine: StateMachine | None = None,
        memory: Memory | None = None,
        journal: ToolJournal | None = None,
        tracer: Tracer | None = None,
        context: ContextBudget | None = None,
        guards: GuardConfig | None = None,
        memory_budget_tokens: int = 800,
        masker: PIIMasker | None = DEFAULT_MASKER,
        vault: Vault | None = None,
        model_sees: ModelSees = "placeholders",
        tenant_id: str = "default",
        name: str = "agent",
        lease_ttl_s: float = 10.0,
        session_wait_s: float | None = None,
        session_cache_size: int = 256,
        output_type: type[Any] | None = None,
        model_options: ModelOptions | None = None,
        approvals: Approvals | None = None,
    ) -> None:
        if not isinstance(system_prompt, str) or not system_prompt.strip():
            raise UsageError("an agent needs a system prompt")
        require_id("tenant_id", tenant_id)
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
        self.machine, self.approvals, self.memory = machine, approvals, memory
        self.journal = journal
        # Without a durable journal, one in memory for the agent's life: exactly-once and the
        # in-doubt guard then hold across this process's turns (not across a crash).
        self._journal: ToolJournal = journal if journal is not None else InMemoryJournal()
        self.tracer = tracer or Tracer(None, agent=name)
        self.guards = guards or GuardConfig()
        self.memory_budget_tokens = memory_budget_tokens
        self.masker = masker
        self.vault, self.model_sees = vault, checked_model_sees(model_sees, vault)
        self._no_vault = NoVault()  # without a vault: refuses placeholders, warns once an agent
        self.tenant_id, self.name = tenant_id, name
        self.lease_ttl_s = lease_ttl_s
        self.session_wait_s = lease_ttl_s + 5.0 if session_wait_s is None else session_wait_s
        self._workflow = Workflow(machine, tools)
        self._hand_off = hand_off(memory, self.vault, tenant_id, memory_budget_tokens)
        self.engine = ContextEngine(model, budget=context)
        self.monitor = SpiralMonitor(prompt_limit=self.engine.budget.limit)
        # Bounded: a long-running service sees sessions come and go; an evicted one is rebuilt
        # from the store on its next turn.
        self._logs = SessionLogs(self.engine, session_cache_size)
        self.backends: Backends | None = None
        """The stores [`open`][] opened (and closes); None for an agent built by hand."""

    # --- construction (the wiring is in runtime/_open.py) -----------------------------------

    @classmethod
    def open(
        cls,
        database: str | Settings | None = None,
        /,
        *,
        system_prompt: str,
        **options: Unpack[OpenOptions],
    ) -> Agent:
        """An agent whose state, tool journal, traces and memory are opened from one URL.

        ``Agent.open("postgresql://u@host/db", system_prompt=...)``, ``Agent.open(settings,
        ...)`` or ``Agent.open(system_prompt=...)`` (``KEEL_DATABASE``, default: the SQLite
        file in the data directory). ``sqlite:///PATH``: one file holds everything, as
        [`embedded`][]. ``postgresql://...``: the PostgreSQL stores. A Redis URL
        (``redis_url``, default ``KEEL_REDIS_URL``) moves state and session leases to Redis;
        the journal, traces and memory stay on the SQL database.

        Args:
            database: a database URL, or the settings to read it from (default: the
                ``settings`` argument, else [`load_settings`][]).
            system_prompt: identity and guardrails.
            model: a ChatModel or a model spec (default: ``settings.model``).
            tools / rules / machine: as for the constructor.
            memory: open long-term memory (embedder: ``settings.embedder``; default True).
            journal: use the durable tool journal (default True). False (a control, not for
                production): the agent keeps one in this process's memory, which a crash loses.
            redis_url: ``redis://...`` for state (default: ``settings.redis_url``; ``""``
                keeps state on the database even when ``KEEL_REDIS_URL`` is set).
            settings: model, embedder, SQLite busy timeout, and the URLs not given.
            options: passed to the constructor (``context=``, ``guards=``, ``masker=``,
                ``tenant_id=``, ``name=``, ...). The masker is also memory's and the tracer's.

        Close the agent with [`aclose`][] (or ``close``): it stops memory's outbox worker
        (what is left stays in the durable outbox) and releases every connection it opened.

        Raises:
            ConfigError: a URL keel cannot open, or ``settings`` given twice.
            BackendUnavailableError: a server cannot be reached or its driver is missing.
            StoreError: a database cannot be opened or migrated.
        """
        return open_agent(cls, database, system_prompt=system_prompt, **options)

    @classmethod
    def on_backends(
        cls,
        backends: Backends,
        model: ChatModel,
        *,
        system_prompt: str,
        **options: Unpack[OnBackendsOptions],
    ) -> Agent:
        """An agent on stores already open (several agents may share them: one per tenant,
        say). The caller keeps the stores: closing the agent does not close them.

        ``options`` are the constructor's (``tools=``, ``tenant_id=``, ``masker=``, ...);
        state, memory, the journal (unless ``journal`` is False), the vault and the tracer
        come from ``backends``, the tracer masking with the agent's privacy policy."""
        return agent_on_backends(cls, backends, model, system_prompt=system_prompt, **options)

    @classmethod
    def embedded(
        cls,
        model: ChatModel | str | None = None,
        *,
        system_prompt: str,
        **options: Unpack[EmbeddedOptions],
    ) -> Agent:
        """An agent on the embedded default: one SQLite file holds state, the tool journal,
        traces and memory; the model is a spec (default: ``settings.model``) or a ChatModel.

        ``memory=``, ``journal=`` and ``settings=`` are [`open`][]'s, the other ``options``
        are passed to the constructor (``context=``, ``guards=``, ...). Close the agent with
        [`aclose`][] (or ``close``) to flush memory and release the database. [`open`][] is
        the same on any database (and Redis); this one refuses a server URL.

        Raises:
            UsageError: the settings name a server database (use [`open`][]).
        """
        return embedded_agent(cls, model, system_prompt=system_prompt, **options)

    async def aclose(self) -> None:
        """Stop the MCP servers this agent started, flush memory's outbox and release what
        [`open`][] / [`embedded`][] opened."""
        try:
            await self._workflow.mcp.aclose()
        finally:
            if self.backends is not None:
                await close_opened(self.backends)

    def close(self) -> None:
        """Sync twin of [`aclose`][], on the bridge loop the sync twins ran on: async clients
        opened by ``handle_sync`` are closed on their own loop. ``with Agent.open(...) as
        agent:`` (or ``async with``) closes it at the end of the block."""
        run_sync(self.aclose())

    async def __aenter__(self) -> Agent:
        await self._workflow.mcp.open()  # a server that cannot start fails here, not mid-turn
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __enter__(self) -> Agent:
        self._workflow.mcp.open_sync()
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
        return await self._hand_over().answer(session_id, user_id, text, None, None)

    async def run(
        self, text: str, *, session: str, user: str, **options: Unpack[TurnOptions]
    ) -> AgentReply:
        """Process one user message of ``user`` in ``session`` and return the reply: the same
        as [`handle`][], with the identities named, so they cannot be swapped.

        Args:
            deps: handed to every tool of the turn that declares a [`ToolContext`][]
                parameter, as ``context.deps`` (a database handle, an API client...).
            output_type: this turn's answer type, instead of the agent's.
            model_options: this turn's generation options, instead of the agent's.
            turn_id: the caller's own id for this turn (an HTTP ``Idempotency-Key``): sent
                again, after a timeout or a crash anywhere, the turn runs once. Its reply was
                committed: it is returned (``replayed``). It was left open: it is finished.
                The same id with another message is a ``UsageError``.
        """
        return await self._hand_over().answer(session, user, text, None, RunExtras(**options))

    def run_sync(
        self, text: str, *, session: str, user: str, **options: Unpack[TurnOptions]
    ) -> AgentReply:
        """Sync twin of [`run`][] (not for use inside a running event loop)."""
        return run_sync(self.run(text, session=session, user=user, **options))

    def stream(
        self, text: str, *, session: str, user: str, **options: Unpack[TurnOptions]
    ) -> AsyncIterator[AgentEvent]:
        """Process one user message as [`run`][] does, yielding its events as they happen:
        masked text deltas, tool calls as they start and end, workflow transitions,
        checkpoints, guard warnings, and last a [`TurnFinished`][] with the reply.

        Every invariant of [`run`][] holds: a checkpoint precedes each model call, text is
        masked before it is yielded. A consumer that stops early (``break``, ``aclose``, a
        cancelled task) stops the turn where it is: the model request ends, the turn stays
        open at its last checkpoint and the next message or [`resume`][] finishes it (with
        ``on_cancel="close"`` it ends there, cancelled, as history says). Raises as run does.
        """
        # The options are read when the iteration starts, as an async generator's body runs.
        return events_of(
            lambda emit: self._hand_over().answer(session, user, text, emit, RunExtras(**options))
        )

    def stream_sync(
        self, text: str, *, session: str, user: str, **options: Unpack[TurnOptions]
    ) -> Iterator[AgentEvent]:
        """Sync twin of [`stream`][]: events arrive as they happen; leaving the loop early
        stops the turn as it does there (not for use inside a running event loop)."""
        return iterate_sync(self.stream(text, session=session, user=user, **options))

    def handle_sync(self, session_id: str, user_id: str, text: str) -> AgentReply:
        """Sync twin of [`handle`][] (not for use inside a running event loop). Safe to call
        from several threads at once: turns on one session take turns through its lease."""
        return run_sync(self.handle(session_id, user_id, text))

    async def resume(self, session_id: str, user_id: str) -> AgentReply | None:
        """Finish a turn that a crash interrupted; None when the session has no open turn.

        Raises:
            AccessDeniedError: the session belongs to another user.
            SessionBusyError: another turn holds the session.
        """
        return await self._hand_over().resume(session_id, user_id)

    def resume_sync(self, session_id: str, user_id: str) -> AgentReply | None:
        """Sync twin of [`resume`][]."""
        return run_sync(self.resume(session_id, user_id))

    async def decide(
        self, session_id: str, approval_id: str, **how: Unpack[DecideOptions]
    ) -> AgentReply:
        """Settle a waiting call (``approve=``; ``by=`` an operator, or ``user_id=`` the user
        confirming; ``note=``, corrected ``arguments=``, ``channel=``): the reply of the turn
        that goes on, its user's values shown (``reveal=False``: placeholders, as stored, for
        a decider who may not read them); the call runs with exactly the arguments decided,
        or not at all.
        AccessDeniedError: not yours to decide. ApprovalSettledError: settled otherwise."""
        return await self._hand_over().decide(session_id, approval_id, **how)

    def decide_sync(
        self, session_id: str, approval_id: str, **how: Unpack[DecideOptions]
    ) -> AgentReply:
        """Sync twin of [`decide`][]."""
        return run_sync(self.decide(session_id, approval_id, **how))

    async def carry_out_decisions(self, user_id: str | None = None) -> list[AgentReply]:
        """Carry out what was decided elsewhere (``keel approvals approve``, HTTP, the viewer,
        another process): each parked turn of this tenant (of ``user_id``) whose requests are
        all decided goes on, once even across processes; the replies of the turns that did."""
        return await self._hand_over().carry_out(user_id)

    def carry_out_decisions_sync(self, user_id: str | None = None) -> list[AgentReply]:
        """Sync twin of [`carry_out_decisions`][]."""
        return run_sync(self.carry_out_decisions(user_id))

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

    async def revert(
        self, session_id: str, *, expected_version: int, to_version: int
    ) -> Checkpoint[AgentState]:
        """Revert the session to ``to_version`` (compare-and-set on ``expected_version``, else
        a ``ConflictError``) under its lease: a turn running on it makes this a
        [`SessionBusyError`][keel.errors.SessionBusyError] at once, nothing changed. What a
        parked turn waited for is cancelled when the state reverted to waits for none of it."""
        return await self._hand_over().revert(
            session_id, expected_version=expected_version, to_version=to_version
        )

    # --- what a turn is handed --------------------------------------------------------------

    def __setattr__(self, name: str, value: Any) -> None:
        # What turns were handed is rebuilt from the configuration once it changes.
        super().__setattr__(name, value)
        if not name.startswith("_"):
            self.__dict__.pop("_turns", None)

    def _hand_over(self) -> Sessions:
        """The agent's sessions, over the parts the agent hands its turns (kept until its
        configuration changes): the dependencies, fixed while turns run, and the logs."""
        turns: Sessions | None = self.__dict__.get("_turns")
        if turns is None:
            endpoints = [self.model.endpoint] if self.model.endpoint else []
            masking = Masking(
                self.masker, self.tenant_id, self.vault, self.model_sees,
                no_vault=self._no_vault, endpoints=endpoints,
            )  # fmt: skip
            deps = TurnDeps(
                self.model, self.state, self.engine, self.monitor, self.guards, self._journal,
                self.tracer, masking, self._workflow, self.system_prompt, self.rules,
                self.output_type, self.model_options, self.tenant_id, self.name,
                self._hand_off, self.approvals,
            )  # fmt: skip
            turns = Sessions(
                deps, self._logs, lease_ttl_s=self.lease_ttl_s, wait_s=self.session_wait_s
            )
            self.__dict__["_turns"] = turns
        return turns
