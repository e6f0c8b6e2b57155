"""How an [`Agent`][] is built on opened stores: the composition root's side
of ``Agent.open``, ``Agent.embedded`` and ``Agent.on_backends``.

The agent is configuration and the public API; opening the stores a URL or settings name,
choosing the model from the settings, wiring one privacy policy through the journal, memory
and traces, and closing what was opened when building fails are done here, by factories that
take the class to build (so a subclass builds a subclass) and never an existing agent.
`AgentOptions` types the constructor's keywords once, so the classmethods that forward
them (``**options: Unpack[...]``) do not repeat its parameter list.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, TypedDict, TypeVar, Unpack

from keel.approvals import ApprovalRequest
from keel.context import ContextBudget, ContextEngine, ContextMemory
from keel.errors import KeelError, UsageError
from keel.guards import GuardConfig, SpiralMonitor
from keel.models import ChatModel, ModelOptions, resolve_model
from keel.privacy import DEFAULT_MASKER, NoVault, PIIMasker, Vault
from keel.runtime._approvals import Approvals
from keel.runtime._hand_off import MemoryHandOff
from keel.runtime._masking import Masking, ModelSees
from keel.runtime._replies import Recent
from keel.runtime._turn import SessionLogs, TurnDeps
from keel.runtime._workflow import Workflow
from keel.settings import Settings, load_settings
from keel.state import AgentState, StateMachine, StateStore
from keel.stores import Backends
from keel.tools import MCPServer, Tool, ToolJournal
from keel.tracing import Tracer

__all__ = [
    "AgentOptions",
    "EmbeddedOptions",
    "OnBackendsOptions",
    "OpenOptions",
    "agent_on_backends",
    "close_opened",
    "embedded_agent",
    "open_agent",
    "turn_deps",
]

logger = logging.getLogger("keel.runtime")


class Configured(Protocol):
    """An agent as this module sees it (the [`Agent`][], which imports this
    module, is not imported back): built from a model and the constructor's options, told the
    stores it owns, and read per turn by `turn_deps`."""

    model: ChatModel
    state: StateStore[AgentState]
    engine: ContextEngine
    monitor: SpiralMonitor
    guards: GuardConfig
    _journal: ToolJournal
    _no_vault: NoVault
    tracer: Tracer
    masker: PIIMasker | None
    vault: Vault | None
    model_sees: ModelSees
    _workflow: Workflow
    system_prompt: str
    rules: tuple[str, ...]
    output_type: type[Any] | None
    model_options: ModelOptions
    tenant_id: str
    name: str
    _sessions: SessionLogs
    _owners: Recent[str, tuple[str, str]]
    _hand_off: MemoryHandOff | None
    approvals: Approvals | None
    backends: Backends | None

    def __init__(self, model: ChatModel, *, system_prompt: str, **options: Any) -> None: ...

    async def _memories(self, user_id: str, query: str) -> list[ContextMemory]: ...


AgentT = TypeVar("AgentT", bound=Configured)

_CLOSE_FLUSH_S = 10.0
"""How long closing an agent waits for memory to embed what its turns wrote."""

_BUILT_FROM_BACKENDS = frozenset({"state", "tracer"})
"""Constructor arguments the factories build from the stores, so a caller cannot pass them."""


class AgentOptions(TypedDict, total=False):
    """The [`Agent`][] constructor's keywords that a factory passes on as
    given (state, memory, the journal and the tracer come from the stores it opens)."""

    tools: Sequence[Tool | MCPServer]
    rules: Sequence[str]
    machine: StateMachine | None
    context: ContextBudget | None
    guards: GuardConfig | None
    memory_budget_tokens: int
    masker: PIIMasker | None
    vault: Vault | None
    model_sees: ModelSees
    tenant_id: str
    name: str
    lease_ttl_s: float
    session_wait_s: float | None
    session_cache_size: int
    output_type: type[Any] | None
    model_options: ModelOptions | None
    approvals: Approvals | None


class OnBackendsOptions(AgentOptions, total=False):
    """[`Agent.on_backends`][]'s options."""

    journal: bool
    on_approval_request: Callable[[ApprovalRequest], Awaitable[None] | None] | None
    """Called once per new approval request in the stores' queue (notify your systems)."""
    escalate: bool | tuple[str, ...]
    """A loop after the warning or a call in doubt goes to the operators' queue instead of
    failing the turn (see [`Approvals`][])."""


class EmbeddedOptions(OnBackendsOptions, total=False):
    """[`Agent.embedded`][]'s options."""

    memory: bool
    settings: Settings | None


class OpenOptions(EmbeddedOptions, total=False):
    """[`Agent.open`][]'s options."""

    model: ChatModel | str | None
    redis_url: str | None


def open_agent(
    cls: type[AgentT],
    database: str | Settings | None,
    *,
    system_prompt: str,
    model: ChatModel | str | None = None,
    memory: bool = True,
    journal: bool = True,
    redis_url: str | None = None,
    settings: Settings | None = None,
    on_approval_request: Callable[[ApprovalRequest], Awaitable[None] | None] | None = None,
    escalate: bool | tuple[str, ...] = False,
    **options: Unpack[AgentOptions],
) -> AgentT:
    """A ``cls`` on the stores ``database`` names, which it owns: see ``Agent.open``."""
    built_here = _BUILT_FROM_BACKENDS & set(options)
    if built_here:
        raise UsageError(
            f"Agent.open builds {sorted(built_here)} from the database URL; to pass your "
            "own stores, construct Agent(...) directly"
        )
    # One privacy policy for messages, the journal, memory and traces; None turns it off.
    privacy = options.get("masker", DEFAULT_MASKER)
    if settings is None and not isinstance(database, Settings):
        settings = load_settings()  # an edge: the settings are read here, once
    backends = Backends.open(
        database, settings=settings, redis_url=redis_url, memory=memory, privacy=privacy
    )
    settings = backends.settings
    try:
        chat_model = model if isinstance(model, ChatModel) else resolve_model(model, settings)
        agent = agent_on_backends(
            cls,
            backends,
            chat_model,
            system_prompt=system_prompt,
            journal=journal,
            on_approval_request=on_approval_request,
            escalate=escalate,
            **options,
        )
    except BaseException:
        backends.close()
        raise
    agent.backends = backends
    return agent


def agent_on_backends(
    cls: type[AgentT],
    backends: Backends,
    model: ChatModel,
    *,
    system_prompt: str,
    journal: bool = True,
    on_approval_request: Callable[[ApprovalRequest], Awaitable[None] | None] | None = None,
    escalate: bool | tuple[str, ...] = False,
    **options: Unpack[AgentOptions],
) -> AgentT:
    """A ``cls`` on stores the caller keeps open: see ``Agent.on_backends``."""
    # The stores' privacy policy unless the agent has its own: one masker for all of it.
    masker = options.setdefault("masker", backends.privacy)
    # The stores' PII vault (KEEL_PII_KEY) unless the agent is given its own, or None.
    options.setdefault("vault", backends.vault)
    tenant_id = options.get("tenant_id", "default")
    # Calls that wait for a person wait in the stores' queue unless the agent has its own.
    options.setdefault(
        "approvals",
        Approvals(backends.approvals, on_request=on_approval_request, escalate=escalate),
    )
    redact = None if masker is None else functools.partial(masker.mask_text, tenant_id=tenant_id)
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


def embedded_agent(
    cls: type[AgentT],
    model: ChatModel | str | None = None,
    *,
    system_prompt: str,
    memory: bool = True,
    settings: Settings | None = None,
    **options: Unpack[OnBackendsOptions],
) -> AgentT:
    """A ``cls`` on the settings' SQLite file, which it owns: see ``Agent.embedded``."""
    settings = settings or load_settings()  # an edge: it must know the URL before open
    if settings.sqlite_path is None:
        raise UsageError(
            f"{settings.parsed_database.kind} databases are opened by "
            "Agent.open, not as the embedded SQLite database"
        )
    # Embedded: everything in the one file, whatever KEEL_REDIS_URL says.
    return open_agent(
        cls,
        settings.database_url,
        model=model,
        system_prompt=system_prompt,
        memory=memory,
        redis_url="",
        settings=settings,
        **options,
    )


async def close_opened(backends: Backends) -> None:
    """Close the stores a factory opened for an agent, memory's outbox flushed first."""
    if backends.memory is not None:
        try:
            # What the last turns wrote is embedded before the worker stops (a process that
            # ends at once would leave it for the next start-up); bounded, and what is left
            # stays in the durable outbox.
            await backends.memory.aflush(timeout=_CLOSE_FLUSH_S)
        except (TimeoutError, KeelError) as exc:
            logger.warning("memory's outbox was not flushed on close: %s", exc)
    await backends.aclose()


def turn_deps(agent: Configured) -> TurnDeps:
    """What a turn takes of ``agent``'s configuration (read per turn: its attributes may be
    set between turns)."""
    return TurnDeps(
        model=agent.model,
        state=agent.state,
        engine=agent.engine,
        monitor=agent.monitor,
        guards=agent.guards,
        journal=agent._journal,
        tracer=agent.tracer,
        masking=Masking(
            agent.masker,
            agent.tenant_id,
            agent.vault,
            agent.model_sees,
            no_vault=agent._no_vault,
            endpoints=[agent.model.endpoint] if agent.model.endpoint else [],
        ),
        workflow=agent._workflow,
        system_prompt=agent.system_prompt,
        rules=agent.rules,
        output_type=agent.output_type,
        model_options=agent.model_options,
        tenant_id=agent.tenant_id,
        name=agent.name,
        logs=agent._sessions,
        owners=agent._owners,
        memory=agent._hand_off,
        recall=agent._memories,
        approvals=agent.approvals,
    )
