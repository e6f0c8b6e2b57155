"""Assembling the service: the stores from one database URL, one agent per tenant on them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from keel.privacy import PIIMasker
from keel.service._app import create_app
from keel.service._drain import Drain
from keel.service._keys import APIKeys
from keel.service._limits import RateLimiter

if TYPE_CHECKING:
    from fastapi import FastAPI

    from keel.models import ChatModel
    from keel.runtime import Agent, Backends
    from keel.tools import Tool

__all__ = ["WARM_CONNECTIONS", "ServiceAgents", "build_service"]

WARM_CONNECTIONS = 4
"""Database connections a worker opens before it reports ready. A turn holds one for a few ms
at a time, so a worker's overlapping turns need a few; a connection opened under load instead
costs its turn a new PostgreSQL server process."""


class ServiceAgents:
    """One :class:`~keel.runtime.Agent` per tenant, all on the same stores, made on first use.

    The agents share the model, the prompt, the tools and the options; each is scoped to its
    tenant (sessions, journal entries, traces, memory).
    """

    def __init__(
        self,
        backends: Backends,
        model: ChatModel,
        *,
        system_prompt: str,
        tools: Sequence[Tool] = (),
        name: str = "agent",
        **agent_options: Any,
    ) -> None:
        self.backends = backends
        self.model = model
        self.system_prompt = system_prompt
        self.tools = tuple(tools)
        self.name = name
        self.agent_options = agent_options
        self._agents: dict[str, Agent] = {}
        self._warm = False

    def __call__(self, tenant_id: str) -> Agent:
        agent = self._agents.get(tenant_id)
        if agent is None:
            from keel.runtime import Agent

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

    async def aready(self) -> None:
        """Wait until the stores answer, with the connections a worker's turns overlap on
        already open (the first call opens them; later ones check one).

        Raises:
            BackendUnavailableError: a server does not answer.
            StoreError: a database cannot be read.
        """
        await self.backends.aready(1 if self._warm else WARM_CONNECTIONS)
        self._warm = True

    def tenants(self) -> list[str]:
        """The tenants whose agent was made."""
        return list(self._agents)

    async def aclose(self) -> None:
        """Close the model's clients and the stores."""
        await self.model.aclose()
        await self.backends.aclose()


def build_service(
    database: str | None = None,
    *,
    model: ChatModel | str | None = None,
    system_prompt: str = "You are a helpful assistant.",
    tools: Sequence[Tool] = (),
    redis_url: str | None = None,
    memory: bool = True,
    max_body_bytes: int = 1_000_000,
    body_timeout_s: float = 30.0,
    metrics_token: str | None = None,
    rate_limit_per_minute: int | None = None,
    drain: Drain | None = None,
    **agent_options: Any,
) -> tuple[FastAPI, ServiceAgents, APIKeys]:
    """The service on ``database`` (default: ``KEEL_DATABASE``, else the embedded SQLite file):
    its app, its agents (close them with ``aclose``) and its API keys.

    ``rate_limit_per_minute``: requests per key and minute (429 beyond), counted in Redis when
    there is one, so that every worker sees the same count."""
    from keel.models import ChatModel, resolve_model
    from keel.runtime import open_backends
    from keel.settings import load_settings

    settings = load_settings()
    url = database or settings.database_url
    backends = open_backends(
        url,
        redis_url=redis_url if redis_url is not None else settings.redis_url,
        memory=memory,
        masker=agent_options.get("masker", PIIMasker()),
        settings=settings,
    )
    try:
        chat = model if isinstance(model, ChatModel) else resolve_model(model or settings.model)
        agents = ServiceAgents(
            backends, chat, system_prompt=system_prompt, tools=tools, **agent_options
        )
        keys = APIKeys(backends.sql)
    except BaseException:
        backends.close()
        raise
    redis = redis_url if redis_url is not None else settings.redis_url
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
        metrics_token=metrics_token,
        tenants=agents.tenants,
        rate_limiter=limiter,
        drain=drain,
        ready=agents.aready,
    )
    return app, agents, keys
