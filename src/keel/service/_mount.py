"""keel inside an existing FastAPI application: [`mount`][]."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from keel.runtime import Agent
from keel.service._serve import build_service
from keel.service._source import AgentSource
from keel.settings import Settings

if TYPE_CHECKING:
    from fastapi import FastAPI

    from keel.service._keys import APIKeys

__all__ = ["mount"]


def mount(
    app: FastAPI,
    agent: Agent | Callable[..., Agent],
    *,
    path: str = "/keel",
    database: str | Settings | None = None,
    memory: bool = True,
    rate_limit_per_minute: int | None = None,
    operators_see_values: bool = False,
    ui: bool = False,
) -> APIKeys:
    """Serve ``agent`` under ``path`` of your FastAPI ``app``: keel's routes (sessions, turns,
    OpenAI's chat completions, approvals, runs) answer at ``{path}/v1/...``, with the same API
    keys and errors as ``keel serve``.

    The agent is served as ``keel serve --agent`` serves it: its definition (model, system
    prompt, tools, rules, workflow, guards) runs on the stores ``database`` names, one agent
    per tenant; a factory is called once per tenant. The stores open when ``app`` starts
    serving requests and close when it shuts down (keel joins ``app``'s lifespan).

    Args:
        app: your application.
        agent: an [`Agent`][keel.Agent], or a function returning one, called as ``f()`` or
            ``f(settings)`` with the service's [`Settings`][keel.settings.Settings].
        path: where keel's routes go (``"/keel"``: ``/keel/v1/chat/completions``).
        database: a database URL, or the settings to read it from (default: the
            environment's, ``KEEL_DATABASE``, else the embedded SQLite file).
        memory: open long-term memory.
        rate_limit_per_minute: requests per API key and minute (429 beyond; None: no limit).
        operators_see_values: a tenant's operator key reads its users' PII values.
        ui: also serve the web trace viewer at ``{path}/ui``.

    Returns:
        The API keys of that database: ``keys.create("acme")`` makes a tenant's operator
        key, ``keys.create("acme", "ada")`` a user's (``keel keys create`` does the same).

    Raises:
        ConfigError: a database URL keel cannot open, or the factory raised.
        UsageError: ``agent`` is not an Agent or a function that returns one.
        BackendUnavailableError: the database server cannot be reached.
    """
    settings = database if isinstance(database, Settings) else None
    url = None if isinstance(database, Settings) else database
    source = AgentSource(agent, "mount(agent=...)")
    service, _, keys = build_service(
        url,
        agent=source,
        memory=memory,
        rate_limit_per_minute=rate_limit_per_minute,
        operators_see_values=operators_see_values,
        settings=settings,
        ui=ui,
    )
    app.mount(path, service)
    # Starlette runs a mounted app's lifespan only through its parent's: keel's (warm the
    # stores, close them at shutdown) runs inside the application's own.
    outer = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(parent: Any) -> AsyncIterator[Any]:
        async with outer(parent) as state, service.router.lifespan_context(service):
            yield state

    app.router.lifespan_context = lifespan
    return keys
