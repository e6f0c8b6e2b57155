"""Assembling the service: the stores from one database URL, one agent per tenant on them.

[`ServeOptions`][keel.service.ServeOptions] is what ``keel serve`` builds its service from:
validated once by the command, handed to each worker process as this model's JSON and
validated again there.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_serializer

from keel._bridge import run_blocking
from keel.errors import ConfigError
from keel.memory import RetentionPolicies
from keel.models import ChatModel, resolve_model
from keel.privacy import DEFAULT_MASKER
from keel.runtime import Agent, Backends
from keel.runtime._workflow import Workflow
from keel.service._app import create_app
from keel.service._drain import Drain
from keel.service._keys import APIKeys
from keel.service._limits import RateLimiter
from keel.service._logging import SERVICE_LOGGER
from keel.service._pruning import service_pruner
from keel.service._source import AgentSource, definition_tools, load_agent
from keel.settings import Settings, load_settings, validation_problems
from keel.stores import ErasureReport, aerase_user
from keel.tools import MCPServer, Tool, start_servers

if TYPE_CHECKING:
    from fastapi import FastAPI

    from keel.state import StateMachine

__all__ = ["WARM_CONNECTIONS", "ServeOptions", "ServiceAgents", "build_service"]

WARM_CONNECTIONS = 4
"""Database connections a worker opens before it reports ready. A turn holds one for a few ms
at a time, so a worker's overlapping turns need a few; a connection opened under load instead
costs its turn a new PostgreSQL server process."""


class ServiceAgents:
    """One [`Agent`][keel.Agent] per tenant, all on the same stores, made on first use.

    The agents share the model, the prompt, the tools and the options; each is scoped to its
    tenant (sessions, journal entries, traces, memory). With ``source`` (the application's
    agent or factory, [`from_source`][keel.service.ServiceAgents.from_source]) each tenant's
    agent is the source's definition instead, a factory called once per tenant.
    """

    def __init__(
        self,
        backends: Backends,
        model: ChatModel,
        *,
        system_prompt: str,
        tools: Sequence[Tool | MCPServer] = (),
        name: str = "agent",
        **agent_options: Any,
    ) -> None:
        self.backends = backends
        self.model = model
        self.source: AgentSource | None = None
        self.settings: Settings | None = None
        self.system_prompt = system_prompt
        self.tools = tuple(tools)
        self.name = name
        self.agent_options = agent_options
        self._agents: dict[str, Agent] = {}
        self._warm = False
        self._embedder_loaded = False
        self._servers: list[MCPServer] = []

    @classmethod
    def from_source(
        cls, backends: Backends, source: AgentSource, settings: Settings
    ) -> ServiceAgents:
        """The agents of ``source`` (checked here: a factory that fails, fails now).

        Raises:
            ConfigError: the factory raised.
            UsageError: the factory returned something other than an Agent.
        """
        template = source.check(settings)
        agents = cls(
            backends, template.model, system_prompt=template.system_prompt, name=template.name
        )
        agents.source, agents.settings = source, settings
        return agents

    def __call__(self, tenant_id: str) -> Agent:
        agent = self._agents.get(tenant_id)
        if agent is None and self.source is not None and self.settings is not None:
            agent = self._agents[tenant_id] = self.source.agent_for(
                tenant_id, self.backends, self.settings
            )
        elif agent is None:
            agent = self._agents[tenant_id] = Agent.on_backends(
                self.backends,
                self.model,
                system_prompt=self.system_prompt,
                tools=self.tools,
                tenant_id=tenant_id,
                name=self.name,
                **self.agent_options,
            )
        return agent

    async def astart(self) -> None:
        """Start the served agent's MCP servers before the service takes traffic: the service
        owns them for its life (the tenants' agents use them as they are, and [`aclose`][]
        stops them), so a server that cannot start fails the start-up, not a tenant's first
        turn. A factory's later calls (one per tenant) may give servers of their own: each
        tenant's agent starts those on its first turn and stops them at shutdown. A server
        over HTTP that cannot be reached yet is left out and retried, as a store that is down
        is reported by ``/ready`` (see ``start_servers``'s ``strict``).

        Raises:
            ToolDefinitionError: a server's command cannot be run, or a stdio server exits
                before listing its tools (the error names the server, its exit code and
                last stderr lines), or two tools share a name (a server's tool named as one
                of a state machine's workflow tools too); the servers started here are
                stopped.
            ConfigError: the ``mcp`` extra is not installed, or a ``FromEnv`` is unset.
            UsageError: a Python tool named as one of a state machine's workflow tools.
        """
        tools, machine = self._definition()
        # A Python tool the workflow reserves fails every tenant's agent as it is built: it
        # fails the start-up instead, servers or none (their tools are checked once listed).
        Workflow(machine, tools)
        servers = [t for t in tools if isinstance(t, MCPServer)]
        if not servers:
            return
        taken = {t.name for t in tools if isinstance(t, Tool)}
        # start_servers waits on keel's bridge loop: off this one, on the blocking pool.
        started = await run_blocking(partial(start_servers, servers, taken=taken, strict=True))
        try:
            # The check each tenant's agent makes as it is built, now that the servers have
            # listed their tools: a clash with the workflow's tools fails here, once.
            Workflow(machine, tools)
        except BaseException:
            # Every server started is stopped, whichever of them fails to stop: the start-up's
            # own error is the one raised, and a process left running would outlive the service.
            for server in reversed(started):
                try:
                    await server.aclose()
                except Exception:
                    SERVICE_LOGGER.warning(
                        "MCP server %r did not stop cleanly", server.name, exc_info=True
                    )
            raise
        self._servers = started

    def _definition(self) -> tuple[list[Tool | MCPServer], StateMachine | None]:
        """The tools and the state machine the served agents are defined with: the source's
        agent's, or ours."""
        if self.source is None or self.settings is None:
            return list(self.tools), self.agent_options.get("machine")
        template = self.source.check(self.settings)
        return definition_tools(template), template.machine

    async def aready(self) -> None:
        """Wait until the stores answer, with the connections a worker's turns overlap on
        already open (the first call opens them; later ones check one), and memory's
        embedder loaded (the first call loads it): the app's start-up awaits this before
        the worker takes traffic, so that no turn of a (re)started worker waits for a model.

        Raises:
            BackendUnavailableError: a server does not answer.
            StoreError: a database cannot be read.
            ConfigError: the embedder cannot be loaded (its libraries are missing).
        """
        await self._load_embedder()
        await self.backends.aready(1 if self._warm else WARM_CONNECTIONS)
        self._warm = True

    async def _load_embedder(self) -> None:
        """Load memory's embedder once (on keel's blocking pool), saying so in the log."""
        memory = self.backends.memory
        embedder = None if memory is None else memory.embedder
        if embedder is None or self._embedder_loaded:
            return
        started = time.perf_counter()
        if await run_blocking(embedder.warm):
            took_ms = (time.perf_counter() - started) * 1000
            SERVICE_LOGGER.info("memory's embedder %s loaded (%.0f ms)", embedder.name, took_ms)
        self._embedder_loaded = True

    def tenants(self) -> list[str]:
        """The tenants whose agent was made."""
        return list(self._agents)

    async def aclose(self) -> None:
        """Stop the MCP servers (those [`astart`][] started, and those the tenants' agents
        did), close the models' clients and the stores: each of them, whatever one of them
        raises (the first error is raised at the end)."""
        closers = [agent.aclose for agent in self._agents.values()]  # their MCP servers
        servers, self._servers = self._servers, []
        closers.extend(server.aclose for server in reversed(servers))
        models = {id(self.model): self.model}
        models.update((id(agent.model), agent.model) for agent in self._agents.values())
        closers.extend(model.aclose for model in models.values())
        closers.append(self.backends.aclose)
        errors: list[Exception] = []
        for close in closers:
            try:
                await close()
            except Exception as exc:  # a subprocess or a pool left open would outlive us
                errors.append(exc)
        if errors:
            raise errors[0]


class ServeOptions(BaseModel):
    """The service ``keel serve`` runs: its database, model, prompt and request limits.

    The command validates them once; with ``--workers N`` each worker process receives them as
    this model's JSON ([`to_json`][keel.service.ServeOptions.to_json], in the environment, not
    in the arguments ``ps`` shows) and validates them again
    ([`from_json`][keel.service.ServeOptions.from_json]) before building its service.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    database: str | None = Field(
        default=None, description="Database URL (default: KEEL_DATABASE, else keel.db)."
    )
    model: str | None = Field(default=None, description="Model spec (default: settings.model).")
    agent: str | None = Field(
        default=None,
        description="MODULE:ATTRIBUTE of the application's Agent or factory (instead of "
        "model and system_prompt); each worker loads it.",
    )
    system_prompt: str = "You are a helpful assistant."
    memory: bool = Field(default=True, description="Use long-term memory.")
    max_body_bytes: int = Field(default=1_000_000, description="Larger request bodies get 413.")
    body_timeout_s: float = Field(default=30.0, gt=0, description="Seconds a body may take.")
    metrics_token: SecretStr | None = Field(
        default=None, description="Token for GET /metrics; without one the route is off."
    )
    rate_limit_per_minute: int | None = Field(
        default=None, description="Requests per API key and minute (429 beyond)."
    )
    operators_see_values: bool = Field(
        default=False,
        description="A tenant's operator key reads its users' PII values in histories "
        "(without it, placeholders; a user key always reads its own values).",
    )

    @field_serializer("metrics_token", when_used="json")
    def _reveal_token(self, token: SecretStr | None) -> str | None:
        # The JSON goes to this service's own worker processes, which need the token itself.
        return None if token is None else token.get_secret_value()

    def to_json(self) -> str:
        """These options as the JSON [`from_json`][keel.service.ServeOptions.from_json] reads
        (the metrics token in clear)."""
        return self.model_dump_json()

    @classmethod
    def from_json(cls, text: str) -> ServeOptions:
        """Options from [`to_json`][keel.service.ServeOptions.to_json]'s JSON, validated again.

        Raises:
            ConfigError: the JSON is not ServeOptions (one line per field).
        """
        try:
            return cls.model_validate_json(text)
        except ValidationError as exc:
            problems = validation_problems(exc, "options")
            raise ConfigError(f"invalid keel serve options: {problems}") from exc

    def build(
        self, *, drain: Drain | None = None, settings: Settings | None = None
    ) -> tuple[FastAPI, ServiceAgents, APIKeys]:
        """The service these options describe ([`build_service`][keel.service.build_service])."""
        token = self.metrics_token
        source = (
            None
            if self.agent is None
            else AgentSource(load_agent(self.agent), f"--agent {self.agent!r}")
        )
        return build_service(
            self.database,
            agent=source,
            model=self.model,
            system_prompt=self.system_prompt,
            memory=self.memory,
            max_body_bytes=self.max_body_bytes,
            body_timeout_s=self.body_timeout_s,
            metrics_token=None if token is None else token.get_secret_value(),
            rate_limit_per_minute=self.rate_limit_per_minute,
            operators_see_values=self.operators_see_values,
            drain=drain,
            settings=settings,
        )


def build_service(
    database: str | None = None,
    *,
    agent: AgentSource | None = None,
    model: ChatModel | str | None = None,
    system_prompt: str = "You are a helpful assistant.",
    tools: Sequence[Tool | MCPServer] = (),
    redis_url: str | None = None,
    memory: bool = True,
    max_body_bytes: int = 1_000_000,
    body_timeout_s: float = 30.0,
    metrics_token: str | None = None,
    rate_limit_per_minute: int | None = None,
    operators_see_values: bool = False,
    drain: Drain | None = None,
    settings: Settings | None = None,
    ui: bool = True,
    **agent_options: Any,
) -> tuple[FastAPI, ServiceAgents, APIKeys]:
    """The service on ``database`` (default: ``KEEL_DATABASE``, else the embedded SQLite file):
    its app, its agents (close them with ``aclose``) and its API keys. To add keel to your own
    FastAPI application, [`mount`][keel.service.mount] is the simpler door.

    ``agent``: the application's agent or factory, served instead of ``model``,
    ``system_prompt`` and ``tools``, one agent per tenant on these stores.

    ``rate_limit_per_minute``: requests per key and minute (429 beyond), counted in Redis when
    there is one, so that every worker sees the same count. ``settings``: read once here (the
    service's edge) when not given; the stores, the model and the agents get them from here.

    With a PII master key (``KEEL_PII_KEY`` / ``KEEL_PII_KEY_FILE`` in the settings) the agents
    keep values in the vault and reads of history show a user key its own values, an operator
    key placeholders (values with ``operators_see_values``).

    Raises:
        VaultKeyError: the master key is malformed, missing from its file, or not this
            vault's (nothing is served, nothing is stored raw).
        ConfigError: ``agent``'s factory raised.
        UsageError: ``agent``'s factory returned something other than an Agent."""
    # The service's edge, opened as Agent.open opens: the settings are read there (when not
    # given) and handed down; every tenant's agent shares the stores and their privacy policy.
    if settings is None:
        settings = load_settings()
    backends = Backends.open(
        database or None,
        settings=settings,
        redis_url=redis_url,
        memory=memory,
        privacy=agent_options.get("masker", DEFAULT_MASKER),
    )
    try:
        if agent is not None:
            agents = ServiceAgents.from_source(backends, agent, settings)
        else:
            chat = model if isinstance(model, ChatModel) else resolve_model(model, settings)
            agents = ServiceAgents(
                backends, chat, system_prompt=system_prompt, tools=tools, **agent_options
            )
        keys = APIKeys(backends.sql)
    except BaseException:
        backends.close()
        raise
    # Counted in the Redis the state is in, if any.
    redis = None if backends.redis is None else backends.redis.url
    limiter = (
        None
        if rate_limit_per_minute is None
        else RateLimiter(rate_limit_per_minute, redis_url=redis)
    )

    async def shutdown() -> None:
        if limiter is not None:
            await limiter.aclose()
        await agents.aclose()

    app = create_app(
        agents,
        keys,
        backends.traces,
        max_body_bytes=max_body_bytes,
        body_timeout_s=body_timeout_s,
        on_shutdown=shutdown,
        on_startup=agents.astart,
        metrics_token=metrics_token,
        tenants=agents.tenants,
        rate_limiter=limiter,
        drain=drain,
        ready=agents.aready,
        vault=backends.vault,
        operators_see_values=operators_see_values,
        approvals=backends.approvals,
        carry_out_every_s=settings.carry_out_every_s,
        ui=ui,
        erase_user=user_eraser(backends, keys),
        pruner=service_pruner(
            None if backends.memory is None else backends.memory.store,
            RetentionPolicies.parse(settings.memory_retention),
            settings.memory_prune_every_s,
        ),
    )
    return app, agents, keys


def user_eraser(
    backends: Backends, keys: APIKeys
) -> Callable[[str, str, str], Awaitable[ErasureReport]]:
    """``POST /v1/privacy/erase``'s work: the user out of every store of ``backends``, and
    their API keys and viewer sessions out of ``keys``."""

    async def erase(tenant_id: str, user_id: str, requested_by: str) -> ErasureReport:
        return await aerase_user(
            backends,
            tenant_id,
            user_id,
            requested_by=requested_by,
            extra={"service": keys.erase_user},
        )

    return erase
